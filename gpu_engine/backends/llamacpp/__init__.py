"""The llama.cpp backend: GGUF models through llama-cpp-python's low-level API, steered
with control vectors or per row in the eval callback, monitored in the eval callback."""

from __future__ import annotations

from typing import Any


def load(job: Any, *, hooks: Any) -> Any:
    """The registry's loader (``gpu_engine.backends``): ``job``'s GGUF model, loaded here."""
    from .backend import LlamaCppBackend

    return LlamaCppBackend(job, hooks)


def check_job(job: Any) -> None:
    """What llama.cpp cannot honour in ``job``, refused by name before anything unloads."""
    from .options import check_options

    check_options(job)
