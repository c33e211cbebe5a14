"""The llama.cpp backend's load options, made whole and checked before anything is read
(what llama.cpp cannot honour is refused by name), and the KV cache's size per token for
each cache type.

Load options (``LoadModelJob.options``, from the site's GGUF_* settings):

- ``context_length`` (GGUF_CONTEXT_LENGTH): a ceiling on the window, over what the file
  declares and what fits in memory; 0 = what the file declares.
- ``kv_cache_type`` (GGUF_KV_CACHE_TYPE) and ``flash_attention`` (GGUF_FLASH_ATTENTION):
  a quantized KV cache needs flash attention, refused otherwise before loading.
- ``tensor_split`` (GGUF_TENSOR_SPLIT): per-card proportions, one per card used.
- the job's device (MILLM_ENGINE_DEVICE): ``cpu`` no offload, ``cuda`` every card split by
  layer, ``cuda:N`` all layers on card N (``main_gpu``, split mode none):
  ``gpu_engine.api.devices.gguf_placement``.
- ``enable_embeddings`` (GGUF_ENABLE_EMBEDDINGS): /v1/embeddings on this model.
- ``steering_mode`` (GGUF_STEERING_MODE): ``auto`` (the self-check decides) or
  ``control_vector_swap`` (the fallback, forced).
- ``gguf_file``: which file of a directory holding several.
- ``prefix_cache_max_mb`` (PREFIX_CACHE_MAX_MB): the prefix cache's budget in MiB
  (``prefix.py``); 0 or absent = off.
"""

from __future__ import annotations

from typing import Any

from ...api.errors import InvalidParameter
from ...api.protocol import LoadModelJob
from .batched import CONTROL_VECTOR_SWAP
from ...api.devices import gguf_placement
from ...api.memory import GGUF_KV_BYTES
from .native import UNQUANTIZED_KV, gpu_device_count

# bytes per KV element for each GGUF_KV_CACHE_TYPE
KV_BYTES = GGUF_KV_BYTES
# share of the host's available memory the KV cache may take (layers on the CPU)
KV_MEMORY_SHARE = 0.5
# share of the cards' free memory (after the weights are on them) the KV cache may take
# with the layers offloaded: llama.cpp's compute buffers take the rest
KV_CARD_SHARE = 0.8
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
    placement = gguf_placement(job.device, n_gpu, [float(x) for x in o.get("tensor_split", [])])
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
        "offload": placement.offload,
        "tensor_split": placement.tensor_split,
        "main_gpu": placement.main_gpu,
        "split_mode": placement.split_mode,
        # the cards holding the layers and the KV cache (none: the CPU)
        "cards": placement.cards(n_gpu),
        "embeddings": bool(o.get("enable_embeddings", True)),
        "gguf_file": o.get("gguf_file") or None,
        "steering_mode": steering_mode,
        # MiB; 0 (and absent: an engine-level load) off (gpu_engine/decode/prefix_cache.py)
        "prefix_cache_max_mb": cache_mb,
    }


__all__ = ["KV_BYTES", "KV_CARD_SHARE", "KV_MEMORY_SHARE", "STEERING_MODE_OPTIONS", "check_options"]
