"""The transformers backend's side of the prefix cache (``gpu_engine.decode.prefix_cache``
keeps the books): what an entry holds — per layer the keys and values of its tokens,
``(1, kv_heads, T, head_dim)``, copied out of the finished request's cache on the model's
device — and how a request starts from one (a full-layer ``DynamicCache`` holding the
reused prefix, on which its prompt's remaining tokens are prefilled at their own
positions).  docs/engine.md, "Prefix cache".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# per layer: (keys, values) of one sequence, (kv_heads, T, head_dim)
LayerKV = Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]


class Payload:
    """One entry's KV, per layer ``(1, kv_heads, T, head_dim)``."""

    __slots__ = ("layers",)

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.layers = layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers for t in kv)


def start_cache(hit: Any) -> Any:
    """A full-layer ``DynamicCache`` holding the first ``hit.length`` positions of
    ``hit.payload`` (views: the forward's own update concatenates, the entry is never
    written)."""
    from transformers import DynamicCache

    n = hit.length
    return DynamicCache(ddp_cache_data=[(k[:, :, :n], v[:, :, :n]) for k, v in hit.payload.layers])


def look_up(cache: Any, plan: Any, prompt_ids: Sequence[int]) -> Any:
    """The hit for a request about to prefill (None: prefill it whole); counts the
    request under its class either way."""
    if cache is None or plan is None or not cache.enabled:
        return None
    if not plan.lookup:
        cache.bypass(plan.klass)
        return None
    return cache.lookup(namespace=plan.namespace, key=plan.key, tokens=prompt_ids, klass=plan.klass)


def store(
    cache: Any, plan: Any, prompt_ids: Sequence[int], generated: Sequence[int], held: int, layer_kv: LayerKV
) -> bool:
    """Keep the KV of a finished request: ``held`` positions whose KV ``layer_kv()`` returns
    (its prompt, then the generated tokens fed back), cut to the prompt unless the steering
    treats generated rows as it would prompt rows (``CachePlan.store_generated``).  The KV is
    copied only when the cache would keep it."""
    if cache is None or plan is None or not cache.enabled:
        return False
    tokens = [*prompt_ids, *generated]
    n = min(held, len(tokens)) if plan.store_generated else min(held, len(prompt_ids))
    if n <= 0:
        return False
    tokens = tokens[:n]
    key = plan.store_key(n)
    if not cache.wants(namespace=plan.namespace, key=key, tokens=tokens):
        return False
    layers = layer_kv()
    if any(k.shape[-2] < n or v.shape[-2] < n for k, v in layers):
        return False  # a layer that kept less (a sliding-window cache): nothing to store
    payload = Payload([(k[:, :n].clone().unsqueeze(0), v[:, :n].clone().unsqueeze(0)) for k, v in layers])
    return cache.store(namespace=plan.namespace, key=key, tokens=tokens, payload=payload, nbytes=payload.nbytes)


__all__ = ["Payload", "look_up", "start_cache", "store"]
