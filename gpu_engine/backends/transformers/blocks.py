"""Decoder-block resolution: where the residual stream after block L lives.

The table is keyed by the checkpoint's architecture class (``config.architectures[0]``
or the loaded model's class name) and lists the attribute path of the block list; more
than one candidate covers layout changes between transformers versions.  This module
imports no torch so ``inspect`` can say whether a checkpoint is supported.
"""

from __future__ import annotations

from typing import Any

from ...errors import SAEIncompatible, UnsupportedArchitecture

_DECODER_LAYERS = ("model.layers",)

BLOCK_LIST_PATHS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": _DECODER_LAYERS,
    "MistralForCausalLM": _DECODER_LAYERS,
    "Qwen2ForCausalLM": _DECODER_LAYERS,
    "Qwen3ForCausalLM": _DECODER_LAYERS,
    "GemmaForCausalLM": _DECODER_LAYERS,
    "Gemma2ForCausalLM": _DECODER_LAYERS,
    "Gemma3ForCausalLM": _DECODER_LAYERS,
    "Gemma3ForConditionalGeneration": ("model.language_model.layers", "language_model.model.layers"),
    "PhiForCausalLM": _DECODER_LAYERS,
    "Phi3ForCausalLM": _DECODER_LAYERS,
    "GPT2LMHeadModel": ("transformer.h",),
    "GPTNeoXForCausalLM": ("gpt_neox.layers",),
}


def is_supported_architecture(architecture_class: str) -> bool:
    return architecture_class in BLOCK_LIST_PATHS


def _walk(root: Any, path: str) -> Any:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_block_list(model: Any) -> tuple[Any, str]:
    """Return ``(module_list, path)`` of the model's decoder blocks."""
    cls_name = type(model).__name__
    candidates = BLOCK_LIST_PATHS.get(cls_name)
    if candidates is None:
        raise UnsupportedArchitecture(cls_name)
    for path in candidates:
        blocks = _walk(model, path)
        if blocks is not None and hasattr(blocks, "__len__") and len(blocks) > 0:
            return blocks, path
    raise UnsupportedArchitecture(cls_name)


def resolve_block(model: Any, layer: int) -> tuple[Any, str]:
    """Return ``(module, path)`` of decoder block ``layer`` (e.g. ``model.layers.12``)."""
    blocks, path = resolve_block_list(model)
    n = len(blocks)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise SAEIncompatible(
            f"Layer {layer} is out of range: the model has {n} decoder blocks (0..{n - 1}).",
            details={"layer": layer, "num_layers": n},
        )
    return blocks[layer], f"{path}.{layer}"


__all__ = ["BLOCK_LIST_PATHS", "is_supported_architecture", "resolve_block", "resolve_block_list"]
