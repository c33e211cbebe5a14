"""The transformers (PyTorch) backend: the model in this process, forward hooks for
steering and monitoring, serial generation or the engine's continuous batching."""

from __future__ import annotations

from typing import Any


def load(job: Any, *, hooks: Any) -> Any:
    """The registry's loader (``gpu_engine.backends``): ``job``'s model, loaded here."""
    from .runner import TransformersRunner

    return TransformersRunner(job, hooks)
