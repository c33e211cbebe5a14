"""The transformers (PyTorch) backend: the model in this process, forward hooks for
steering and monitoring, serial generation or the engine's continuous batching."""

from __future__ import annotations

from typing import Any


def check_job(job: Any) -> None:
    """What this backend cannot honour in ``job``, refused by name before anything
    unloads: a quantization without a kernel here (Q2), or a pre-quantized checkpoint whose
    method cannot load on this host (``quantization``)."""
    from .quantization import check_method, check_prequantized, checkpoint_quantization

    prequantized = checkpoint_quantization(job.path)
    if prequantized is not None:
        # loads at its own precision, never quantized again (the registry's choice is moot)
        check_prequantized(prequantized, job.device)
    elif job.options.get("quantization"):
        check_method(job.options["quantization"], job.device)


def load(job: Any, *, hooks: Any) -> Any:
    """The registry's loader (``gpu_engine.backends``): ``job``'s model, loaded here."""
    from .runner import TransformersRunner

    return TransformersRunner(job, hooks)
