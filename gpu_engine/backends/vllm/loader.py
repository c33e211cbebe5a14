"""The vLLM backend's model loader (``load_format="millm"``) for a model vLLM compiles.

vLLM traces its model once, before any SAE is attached, and from then on runs the traced
graph: a hook added to a decoder layer afterwards never runs (the graph does not look at
the module's hooks again).  This loader is vLLM's own default loader (safetensors only),
plus one step when the weights are in: a graph-safe tap (``gpu_engine.interp.taps``) on
every module this rank holds that a hook may go on (``hook_sites``: each decoder layer's
output pair, its attention and MLP sub-block outputs, the MLP's also carrying its input
for transcoders, and the embedding module; each ``Attention``'s inputs for Q/K capture),
installed before vLLM compiles, so the compiled graph calls ``millm::tap`` there at every
forward: per layer four calls (three with a ``resid_pre``-only model), plus one.  The worker extension
(``worker.py``) hands the taps to its ``HookManager``, which then adds the steering,
monitoring and capture hooks to them instead of to the modules: the same hooks, the same
``route``, eager or compiled.

Registered when this module is imported: the driver imports it (``backend.py``) and every
vLLM worker does, through the worker extension's module, before it loads the model.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ...interp.taps import Tap, install_taps

LOAD_FORMAT = "millm"

# a loaded model -> its decoder layers' taps (the worker extension's HookManager reads them)
_TAPS: weakref.WeakKeyDictionary[torch.nn.Module, dict[torch.nn.Module, Tap]] = weakref.WeakKeyDictionary()


def find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder layers of a vLLM model: the largest ``ModuleList`` named ``layers``/``h``."""
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h"):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise RuntimeError(f"no decoder layer list found in {type(model).__name__}")
    return best


def find_attention(layer: torch.nn.Module) -> torch.nn.Module | None:
    """vLLM's ``Attention`` module of a decoder layer (it takes the rotated q, k and v,
    split over heads as ``num_heads``/``num_kv_heads`` × ``head_size``), or None: a layer
    without one (MLA and other attention kinds take something else), or a pipeline
    stage's placeholder."""
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:  # another vLLM layout: match the class by name
        Attention = None  # noqa: N806
    for _, mod in layer.named_modules():
        if isinstance(mod, Attention) if Attention is not None else type(mod).__name__ == "Attention":
            return mod
    return None


# the inner models (the parent of the decoder layers) whose embedding module's output is
# exactly the stream entering layer 0 (``hidden_states = self.embed_tokens(input_ids)``,
# then the layers; vLLM's Llama, Mistral, Phi-3, Qwen2, Qwen3): Gemma's scale it after the
# module (``* normalizer``), GPT-2's add position embeddings outside any module
EMBED_IS_STREAM = {
    "LlamaModel": "embed_tokens",
    "MistralModel": "embed_tokens",
    "Qwen2Model": "embed_tokens",
    "Qwen3Model": "embed_tokens",
}
_ATTENTION_NAMES = ("self_attn", "attn", "attention")


def _full_output(module: torch.nn.Module, tp_size: int) -> str | None:
    """None when ``module``'s output is the whole tensor on every rank (no tensor
    parallelism, or every row-parallel projection in it all-reduces its result); else why
    not: a rank would steer and read its shard."""
    if tp_size <= 1:
        return None
    from vllm.model_executor.layers.linear import RowParallelLinear

    rows = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
    if not rows:
        return f"under tensor parallelism {type(module).__name__} has no row-parallel projection known to all-reduce its output"
    if any(not m.reduce_results and m.tp_size > 1 for m in rows):
        return f"under tensor parallelism {type(module).__name__}'s output is a shard (reduce_results=False)"
    return None


def hook_sites(model: torch.nn.Module, tp_size: int = 1) -> dict[str, Any]:
    """Where the hook points are on ``model`` (``wire.hook_site`` reads it, on the driver
    and the workers): ``layers`` (the decoder layers' path), ``embed`` (the embedding
    module's path: resid_pre of layer 0), ``attn_out``/``mlp_out``/``mlp_transcoder`` (the
    module's name in a decoder layer), None with the reason in ``why`` where the point
    cannot be hooked exactly.  As on the transformers backend (``blocks.resolve_hook_module``):
    the attention and MLP modules' outputs, or with sandwich norms (Gemma 2/3) the
    post-attention and post-feedforward norms' outputs, where a transcoder is refused.
    Under tensor parallelism a point is kept only where its module's output is all-reduced
    (vLLM's ``RowParallelLinear(reduce_results=True)``, ``VocabParallelEmbedding``'s): every
    rank then holds the whole tensor, never a shard."""
    path, layers = find_layers(model)
    sites: dict[str, Any] = {"layers": path, "embed": None, "attn_out": None, "mlp_out": None, "mlp_transcoder": None}
    why: dict[str, str] = {}
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    name = EMBED_IS_STREAM.get(type(parent).__name__)
    embed = getattr(parent, name, None) if name else None
    if embed is None:
        why["embed"] = (
            f"vLLM's {type(parent).__name__} changes the embeddings' output before layer 0 (or is not known not to); "
            f"supported on {', '.join(sorted(EMBED_IS_STREAM))}"
        )
    elif tp_size > 1 and not getattr(embed, "reduce_results", False):
        why["embed"] = "under tensor parallelism the embedding's output is a shard"
    else:
        sites["embed"] = f"{parent_path}.{name}" if parent_path else name
    layer = next((m for m in layers if held(m)), None)
    if layer is None:
        sites["why"] = why
        return sites
    sandwich = getattr(layer, "post_feedforward_layernorm", None) is not None
    attention = next((n for n in _ATTENTION_NAMES if getattr(layer, n, None) is not None), None)
    mlp = "mlp" if getattr(layer, "mlp", None) is not None else None
    for point, own, sub in (
        ("attn_out", "post_attention_layernorm" if sandwich else attention, attention),
        ("mlp_out", "post_feedforward_layernorm" if sandwich else mlp, mlp),
        ("mlp_transcoder", None if sandwich else mlp, mlp),
    ):
        if own is None or sub is None:
            why[point] = (
                "its MLP output passes a post-feedforward norm before the residual add"
                if point == "mlp_transcoder" and sandwich
                else f"its decoder layer {type(layer).__name__} has no such module"
            )
            continue
        # the sub-block's output (a sandwich norm's input) must be whole on every rank
        shard = _full_output(getattr(layer, sub), tp_size)
        if shard is not None:
            why[point] = shard
            continue
        sites[point] = own
    sites["why"] = why
    return sites


def held(layer: torch.nn.Module) -> bool:
    """Whether this rank runs ``layer`` (pipeline parallelism leaves the others empty)."""
    return type(layer).__name__ != "PPMissingLayer"


def taps_of(model: torch.nn.Module) -> dict[torch.nn.Module, Tap]:
    """The taps this loader put on ``model`` (none: it was loaded eager, without them)."""
    return _TAPS.get(model, {})


def parallel_size(vllm_config: Any) -> int:
    """The tensor-parallel size of a load."""
    return int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)


@register_model_loader(LOAD_FORMAT)
class MillmModelLoader(DefaultModelLoader):
    """vLLM's default loader reading safetensors, then a tap on each decoder layer."""

    def __init__(self, load_config: Any) -> None:
        own = copy.copy(load_config)
        own.load_format = "safetensors"  # weights come only from safetensors here
        super().__init__(own)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        _, layers = find_layers(model)
        mine = [layer for layer in layers if held(layer)]
        taps = install_taps(mine, residual_pair=True)
        # the hook points inside the layers and the embeddings (resid_pre of layer 0), where
        # this model has them exactly (hook_sites); the MLP's tap carries its input when a
        # transcoder may read it
        sites = hook_sites(model, parallel_size(vllm_config))
        outputs = {sites[p] for p in ("attn_out", "mlp_out") if sites[p] is not None}
        with_input = sites["mlp_transcoder"]
        for name in sorted(outputs - {with_input}):
            taps.update(install_taps([getattr(layer, name) for layer in mine]))
        if with_input is not None:
            taps.update(install_taps([getattr(layer, with_input) for layer in mine], with_input=True))
        if sites["embed"] is not None and mine and layers[0] is mine[0]:
            taps.update(install_taps([model.get_submodule(sites["embed"])]))
        # Q/K capture reads the rotated query and key where vLLM's Attention takes them
        attention = [a for a in (find_attention(layer) for layer in mine) if a is not None]
        taps.update(install_taps(attention, inputs=True))
        _TAPS[model] = taps
        return model


__all__ = [
    "EMBED_IS_STREAM",
    "LOAD_FORMAT",
    "MillmModelLoader",
    "find_attention",
    "find_layers",
    "held",
    "hook_sites",
    "taps_of",
]
