"""Attention Q/K capture on the transformers backend: a tap where the rotated q and k exist.

Every attention module of the architectures we support computes its projections, applies
its own position encoding (rotary for Llama/Gemma/Qwen/…, partial rotary for Phi and
GPT-NeoX, none for GPT-2; ``q_norm``/``k_norm`` first where the model has them), appends
the new keys to the cache, and then calls one *attention function* looked up by name in
transformers' ``AttentionInterface`` with ``(module, query, key, value, mask, …)``:
``query`` (batch, heads, tokens, head_dim) and ``key`` (batch, kv_heads, cached + tokens,
head_dim) are exactly what the attention multiplies.  Reading them there is exact for
every architecture without re-implementing any of them: the new keys are the last
``tokens`` slots of ``key`` in every cache we use (``DynamicCache``, its sliding layers,
``BatchKVCache``), and the row order ``batch × tokens`` is the flattened row order the
other hooks see, so left-padded prefills and batched decode steps need nothing special.

How it is switched on: while some running request captures Q/K, the model's attention
implementation is set to ``millm_qk_tap_<inner>`` — registered here, with the inner
implementation's mask function — which calls the module's tap (if the module has one)
and then the inner function unchanged.  With no Q/K capture armed the model runs its own
implementation: the unarmed path is the code that ran before.  Which modules tap is an
attribute the ``QKTaps`` owner sets on arm and deletes on disarm (reference-counted per
layer); nothing survives the last request that armed it.

GQA: ``key`` holds ``kv_heads`` heads; query head ``h`` attends with kv head
``h // (heads // kv_heads)`` (transformers' ``repeat_kv`` repeats each kv head for a run of
consecutive query heads).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...interp.capture import route_qk

PREFIX = "millm_qk_tap_"
TAP_ATTR = "_millm_qk_tap"
_registered: set[str] = set()


def _inner_function(module: torch.nn.Module, inner: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":  # each model's own eager function (softcapping, sinks, …)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def tap_name(inner: str) -> str:
    """Register (once) the tapping attention function over ``inner``; returns its name."""
    name = PREFIX + inner
    if name in _registered:
        return name
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        tap = getattr(module, TAP_ATTR, None)
        if tap is not None:
            tap(query, key)
        return _inner_function(module, inner)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    _registered.add(name)
    return name


class QKTap:
    """Set on an attention module while its layer's Q/K is captured; reads the hook
    manager's current ``BatchContext`` like the block hooks do and changes nothing."""

    def __init__(self, layer: int, manager: Any) -> None:
        self.layer = layer
        self.manager = manager

    def __call__(self, query: torch.Tensor, key: torch.Tensor) -> None:
        ctx = self.manager.current
        if ctx is None:
            return
        b, h, t, d = query.shape
        q = query.transpose(1, 2).reshape(b * t, h, d)
        k = key[:, :, key.shape[2] - t :].transpose(1, 2).reshape(b * t, key.shape[1], d)
        route_qk(ctx, self.layer, q, k)


class QKTaps:
    """Which attention modules tap, reference-counted per layer, and the model's attention
    implementation switched to the tapping one while any does (see the module doc)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self._armed: dict[int, list[Any]] = {}  # layer -> [module, references]
        self._model: Any = None
        self._inner: str | None = None

    def arm(self, layer: int, module: torch.nn.Module, model: Any) -> None:
        entry = self._armed.get(layer)
        if entry is not None:
            entry[1] += 1
            return
        if not self._armed:
            inner = model.config._attn_implementation or "eager"
            model.set_attn_implementation(tap_name(inner))
            self._model, self._inner = model, inner
        setattr(module, TAP_ATTR, QKTap(layer, self.manager))
        self._armed[layer] = [module, 1]

    def disarm(self, layer: int) -> None:
        entry = self._armed.get(layer)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        if hasattr(entry[0], TAP_ATTR):
            delattr(entry[0], TAP_ATTR)
        del self._armed[layer]
        if not self._armed and self._model is not None:
            self._model.set_attn_implementation(self._inner)
            self._model = self._inner = None

    def armed(self) -> list[int]:
        return sorted(self._armed)


__all__ = ["PREFIX", "QKTap", "QKTaps", "tap_name"]
