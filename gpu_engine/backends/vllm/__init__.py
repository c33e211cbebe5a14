"""The vLLM backend: vLLM's V1 engine serves the model (its scheduling, continuous batching
and paged KV cache); per-request steering and monitoring run inside vLLM's workers through
a worker extension (``worker``), carried by each request (``wire``).  ``backend`` is the
driver, ``batch`` routes the engine's batch scheduler onto ``LLMEngine``.  Only imported
when a model is loaded on it: vLLM is an extra (``scripts/setup vllm``)."""

from __future__ import annotations

from typing import Any

from .cards import check_job

__all__ = ["check_job", "load"]  # check_job: the registry's validator (gpu_engine.api.backends)


def load(job: Any, *, hooks: Any) -> Any:
    """The registry's loader (``gpu_engine.backends``): ``job``'s model on vLLM."""
    from .backend import VllmBackend

    return VllmBackend(job, hooks)
