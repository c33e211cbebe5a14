"""The llama.cpp backend's load options, made whole and checked before anything is read
(what llama.cpp cannot honour is refused by name), and the KV cache's size per token for
each cache type.

Load options (``LoadModelJob.options``, from the site's GGUF_* settings):

- ``context_length`` (GGUF_CONTEXT_LENGTH): a ceiling on the window, over what the file
  declares and what fits in memory; 0 = what the file declares.
- ``kv_cache_type`` (GGUF_KV_CACHE_TYPE) and ``flash_attention`` (GGUF_FLASH_ATTENTION):
  a quantized KV cache needs flash attention, refused otherwise before loading.
- ``tensor_split`` (GGUF_TENSOR_SPLIT): per-card proportions, one per card used.
- ``enable_embeddings`` (GGUF_ENABLE_EMBEDDINGS): /v1/embeddings on this model.
- ``steering_mode`` (GGUF_STEERING_MODE): ``auto`` (the self-check decides) or
  ``control_vector_swap`` (the fallback, forced).
- ``gguf_file``: which file of a directory holding several.
- ``prefix_cache_max_mb`` (PREFIX_CACHE_MAX_MB): the prefix cache's budget in MiB
  (``prefix.py``); 0 or absent = off.
"""

from __future__ import annotations

from typing import Any

from ...api.errors import InvalidParameter, ModelLoadFailed
from ...api.protocol import LoadModelJob
from .batched import CONTROL_VECTOR_SWAP
from .native import UNQUANTIZED_KV, check_tensor_split, gpu_device_count

# bytes per KV element for each GGUF_KV_CACHE_TYPE (block size / elements per block)
KV_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
# share of the host's available memory the KV cache may take
KV_MEMORY_SHARE = 0.5
# GGUF_STEERING_MODE: let the load decide, or force the fallback
STEERING_MODE_OPTIONS = ("auto", CONTROL_VECTOR_SWAP)


def check_options(job: LoadModelJob) -> dict[str, Any]:
    """The load options made whole and checked, before anything is read: what llama.cpp
    cannot honour is refused by name."""
    o = job.options
    kv = o.get("kv_cache_type", "f16")
    if kv not in KV_BYTES:
        raise InvalidParameter(
            f"GGUF_KV_CACHE_TYPE {kv!r} is not one of {', '.join(KV_BYTES)}",
            param="options.kv_cache_type",
        )
    fa = o.get("flash_attention", True)
    if not fa and kv not in UNQUANTIZED_KV:
        raise InvalidParameter(
            f"GGUF_FLASH_ATTENTION=false cannot run a quantized KV cache ({kv}); use f16 or turn flash attention on",
            param="options.flash_attention",
            details={"kv_cache_type": kv},
        )
    ctx = o.get("context_length", 0)
    if ctx < 0:
        raise InvalidParameter("GGUF_CONTEXT_LENGTH must be >= 0", param="options.context_length")
    if job.trust_remote_code:
        raise InvalidParameter("trust_remote_code has no meaning for a GGUF model", param="trust_remote_code")
    n_gpu = gpu_device_count()
    if job.device.startswith("cuda") and n_gpu == 0:
        raise ModelLoadFailed(
            "device 'cuda' requested but this llama.cpp build has no GPU offload",
            details={"device": job.device},
        )
    offload = n_gpu > 0 and job.device != "cpu"
    split = [float(x) for x in o.get("tensor_split", [])]
    if split:
        if not offload:
            raise InvalidParameter(
                "GGUF_TENSOR_SPLIT needs GPU offload; this load runs on the CPU",
                param="options.tensor_split",
            )
        split = check_tensor_split(split, n_gpu)
    cache_mb = o.get("prefix_cache_max_mb", 0)
    if cache_mb < 0:
        raise InvalidParameter("PREFIX_CACHE_MAX_MB must be >= 0", param="options.prefix_cache_max_mb")
    steering_mode = o.get("steering_mode", "auto")
    if steering_mode not in STEERING_MODE_OPTIONS:
        raise InvalidParameter(
            f"GGUF_STEERING_MODE {steering_mode!r} is not one of {', '.join(STEERING_MODE_OPTIONS)}",
            param="options.steering_mode",
        )
    return {
        "kv": kv,
        "flash_attention": bool(fa),
        "context_length": int(ctx),
        "offload": offload,
        "tensor_split": split,
        "embeddings": bool(o.get("enable_embeddings", True)),
        "gguf_file": o.get("gguf_file") or None,
        "steering_mode": steering_mode,
        # MiB; 0 (and absent: an engine-level load) off (gpu_engine/decode/prefix_cache.py)
        "prefix_cache_max_mb": cache_mb,
    }


__all__ = ["KV_BYTES", "KV_MEMORY_SHARE", "STEERING_MODE_OPTIONS", "check_options"]
