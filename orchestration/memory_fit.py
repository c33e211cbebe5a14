"""Whether a transformers model, or an SAE beside it, fits the engine's memory: decided
before anything is moved.

The rule (the original's "Hardware Requirements", for one card or the CPU):

- a model load needs its weights at the load dtype plus the KV cache of
  ``TRANSFORMERS_MIN_CONTEXT`` tokens (the model's own maximum if shorter), all of it
  float32/16 as it will sit in memory;
- an SAE attach needs the SAE's tensors (float32, as ``gpu_engine.sae`` keeps them) and
  leaves that same KV room free beside the resident model;
- a CUDA card keeps ``TRANSFORMERS_CUDA_CONTEXT_MB`` for its CUDA context out of what it
  reports free; on the CPU the same rule holds against the host's available memory
  (``MemAvailable`` on the engine's host);
- a load that replaces the resident model counts that model's estimate as free again.

A refusal is ``INSUFFICIENT_MEMORY`` (507) whose details name, per card (``cards``), what it
has free, what it keeps for its context and what the load needed. Only the transformers
backend is judged here: llama.cpp fits its context to the memory itself and vLLM takes
``VLLM_GPU_MEMORY_UTILIZATION`` of the card.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from core.errors import InsufficientMemory
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from gpu_engine.api.host import inspect_model_dir
from registry.models import SAE, Model

MB = 2**20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# the SAE modules keep float32 whatever the model's dtype (gpu_engine/sae/module.py)
SAE_DTYPE_BYTES = 4


@dataclass(frozen=True)
class ModelNeeds:
    weights: int
    kv_per_token: int
    reserve_tokens: int

    @property
    def kv_reserve(self) -> int:
        return self.kv_per_token * self.reserve_tokens


def model_needs(model: Model, dtype: str) -> ModelNeeds | None:
    """The weights and the KV room a load of ``model`` at ``dtype`` needs, read from its
    checkpoint's config and safetensors headers; None when there is no local checkpoint
    to read (nothing to judge by)."""
    path = Path(model.local_path) if model.local_path else None
    if path is None or not path.is_dir():
        return None
    width = DTYPE_BYTES.get(dtype, 4)
    try:
        info = inspect_model_dir(path, "float32", context_tokens=0)
    except EngineError:
        return None
    window = info.context_length or int(settings.TRANSFORMERS_MIN_CONTEXT)
    reserve = min(window, int(settings.TRANSFORMERS_MIN_CONTEXT))
    kv_per_token = 2 * info.num_layers * info.num_key_value_heads * info.head_dim * width
    return ModelNeeds(weights=info.param_count * width, kv_per_token=kv_per_token, reserve_tokens=reserve)


def sae_bytes(sae: SAE) -> int:
    """An SAE's tensors as the engine holds them: encoder and decoder, their biases and a
    threshold (a steering vector: one row per layer it has)."""
    d_in, d_sae = int(sae.d_in or 0), int(sae.d_sae or 0)
    if sae.format == SAE.Format.VECTOR:
        return SAE_DTYPE_BYTES * d_in * max(len(sae.vector_layers or []), 1)
    return SAE_DTYPE_BYTES * (2 * d_in * d_sae + 2 * d_sae + d_in)


def _cards(device: str, needed: int, reclaim: int = 0) -> tuple[list[dict[str, Any]], bool] | None:
    """Per card the load uses: free, kept for the CUDA context, usable, needed; and whether
    it fits. None when the engine cannot say what is free."""
    free = runtime().engine.free_memory(device)
    if free is None:
        return None
    context = int(settings.TRANSFORMERS_CUDA_CONTEXT_MB) * MB if device.startswith("cuda") else 0
    usable = max(free + reclaim - context, 0)
    card = {
        "device": device,
        "free_mb": round(free / MB),
        "reclaimed_mb": round(reclaim / MB),
        "context_reserve_mb": round(context / MB),
        "usable_mb": round(usable / MB),
        "needed_mb": round(needed / MB),
    }
    return [card], needed <= usable


def check_model_fits(model: Model, device: str, dtype: str, *, resident: Model | None) -> None:
    """Refuse (507) a transformers load that does not fit ``device`` before anything moves."""
    if model.effective_backend() != "transformers":
        return
    needs = model_needs(model, dtype)
    if needs is None:
        return
    needed = needs.weights + needs.kv_reserve
    # the resident model's memory comes back before the new weights arrive
    reclaim = 0
    if resident is not None:
        before = model_needs(resident, dtype)
        reclaim = before.weights if before is not None else resident.estimated_memory_bytes or 0
    judged = _cards(device, needed, reclaim)
    if judged is None:
        return
    cards, fits = judged
    if fits:
        return
    raise InsufficientMemory(
        f"Model {model.name!r} needs about {needed / MB:.0f} MB on {device} (weights "
        f"{needs.weights / MB:.0f} MB + the KV cache of {needs.reserve_tokens} tokens, "
        f"{needs.kv_reserve / MB:.0f} MB); {cards[0]['usable_mb']} MB are usable there",
        details={
            "model_id": model.id,
            "device": device,
            "dtype": dtype,
            "needed_mb": round(needed / MB),
            "weights_mb": round(needs.weights / MB),
            "kv_cache_mb": round(needs.kv_reserve / MB),
            "min_context_tokens": needs.reserve_tokens,
            "cards": cards,
        },
    )


def check_saes_fit(saes: list[SAE], *, model: Model, device: str, dtype: str) -> None:
    """Refuse (507) attaching ``saes`` when, beside the resident model, they would not leave
    its KV room (TRANSFORMERS_MIN_CONTEXT tokens) free."""
    if not saes or model.effective_backend() != "transformers":
        return
    needs = model_needs(model, dtype)
    if needs is None:
        return
    sizes = sum(sae_bytes(sae) for sae in saes)
    needed = sizes + needs.kv_reserve
    judged = _cards(device, needed)
    if judged is None:
        return
    cards, fits = judged
    if fits:
        return
    raise InsufficientMemory(
        f"Attaching {', '.join(s.id for s in saes)} needs about {sizes / MB:.0f} MB on {device} "
        f"and must leave the KV cache of {needs.reserve_tokens} tokens "
        f"({needs.kv_reserve / MB:.0f} MB) free; {cards[0]['usable_mb']} MB are usable there",
        details={
            "sae_ids": [s.id for s in saes],
            "device": device,
            "needed_mb": round(needed / MB),
            "sae_mb": round(sizes / MB),
            "kv_cache_mb": round(needs.kv_reserve / MB),
            "min_context_tokens": needs.reserve_tokens,
            "cards": cards,
        },
    )


__all__ = ["check_model_fits", "check_saes_fit", "model_needs", "sae_bytes"]
