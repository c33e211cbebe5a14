"""Decoder-block resolution: where the residual stream after block L lives, and the
module an SAE's hook point (``gpu_engine.sae.hookpoints``) lands on at layer L.

The table is keyed by the checkpoint's architecture class (``config.architectures[0]``
or the loaded model's class name) and lists the attribute path of the block list; more
than one candidate covers layout changes between transformers versions.  The table
itself lives in ``gpu_engine.api.architectures`` (torch-free, and no backend), where
``inspect`` reads it to say whether a checkpoint is supported.
"""

from __future__ import annotations

from typing import Any

from ...api.architectures import BLOCK_LIST_PATHS, is_supported_architecture
from ...api.errors import SAEIncompatible, UnsupportedArchitecture


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


# the module whose output is the residual stream entering block 0, relative to the
# block list's parent (embeddings plus anything added before block 0: GPT-2's position
# embeddings, the embedding dropout of GPT-NeoX and Phi; Gemma scales inside its
# embedding module)
EMBED_OUTPUT_NAMES: dict[str, str] = {
    "GPT2LMHeadModel": "drop",
    "GPTNeoXForCausalLM": "emb_dropout",
    "PhiForCausalLM": "embed_dropout",
}
_ATTENTION_NAMES = ("self_attn", "attn", "attention")


def resolve_hook_module(model: Any, layer: int, hook_point: str) -> tuple[Any, str, bool]:
    """``(module, path, read_input)`` for an SAE of kind ``hook_point`` attached at ``layer``.

    ``read_input``: the SAE reads the module's input and writes its output (transcoders).
    Blocks with sandwich norms (Gemma 2/3: ``post_feedforward_layernorm``) add the
    *normalised* sub-block outputs to the residual stream, so ``attn_out``/``mlp_out``
    are those norms' outputs there; a transcoder, which would read the MLP's input and
    write past a norm it does not own, is refused on them.
    """
    block, block_path = resolve_block(model, layer)
    if hook_point == "resid_post":
        return block, block_path, False
    if hook_point == "resid_pre":
        if layer > 0:
            module, path = resolve_block(model, layer - 1)
            return module, path, False
        _, list_path = resolve_block_list(model)
        parent = list_path.rsplit(".", 1)[0]
        path = f"{parent}.{EMBED_OUTPUT_NAMES.get(type(model).__name__, 'embed_tokens')}"
        module = _walk(model, path)
        if module is None:
            raise SAEIncompatible(
                f"hook point resid_pre of layer 0: {type(model).__name__} has no {path}",
                details={"hook_point": hook_point, "layer": layer},
            )
        return module, path, False
    sandwich = getattr(block, "post_feedforward_layernorm", None) is not None
    if hook_point == "attn_out":
        names = ("post_attention_layernorm",) if sandwich else _ATTENTION_NAMES
    elif hook_point == "mlp_out":
        names = ("post_feedforward_layernorm",) if sandwich else ("mlp",)
    elif hook_point == "mlp_transcoder":
        if sandwich:
            raise SAEIncompatible(
                f"a transcoder (hook point {hook_point}) cannot be attached to {type(model).__name__}: its MLP "
                "output passes a post-feedforward norm before the residual add",
                details={"hook_point": hook_point, "architecture_class": type(model).__name__},
            )
        names = ("mlp",)
    else:
        raise SAEIncompatible(f"unknown hook point {hook_point!r}", details={"hook_point": hook_point})
    for name in names:
        module = getattr(block, name, None)
        if module is not None:
            return module, f"{block_path}.{name}", hook_point == "mlp_transcoder"
    raise SAEIncompatible(
        f"hook point {hook_point}: block {block_path} of {type(model).__name__} has none of {', '.join(names)}",
        details={"hook_point": hook_point, "layer": layer},
    )


def resolve_attention(model: Any, layer: int) -> tuple[Any, str]:
    """``(module, path)`` of block ``layer``'s self-attention (the module whose attention
    function a Q/K capture taps)."""
    block, block_path = resolve_block(model, layer)
    for name in _ATTENTION_NAMES:
        module = getattr(block, name, None)
        if module is not None:
            return module, f"{block_path}.{name}"
    raise UnsupportedArchitecture(
        f"{type(model).__name__}: block {block_path} has none of {', '.join(_ATTENTION_NAMES)}"
    )


__all__ = [
    "BLOCK_LIST_PATHS",
    "EMBED_OUTPUT_NAMES",
    "is_supported_architecture",
    "resolve_block",
    "resolve_attention",
    "resolve_block_list",
    "resolve_hook_module",
]
