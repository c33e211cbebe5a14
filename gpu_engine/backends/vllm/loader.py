"""The vLLM backend's model loader (``load_format="millm"``) for a model vLLM compiles.

vLLM traces its model once, before any SAE is attached, and from then on runs the traced
graph: a hook added to a decoder layer afterwards never runs (the graph does not look at
the module's hooks again).  This loader is vLLM's own default loader (safetensors only),
plus one step when the weights are in: a graph-safe tap (``gpu_engine.interp.taps``) on
every decoder layer this rank holds, installed before vLLM compiles, so the compiled
graph calls ``millm::tap`` after each layer at every forward.  The worker extension
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


def held(layer: torch.nn.Module) -> bool:
    """Whether this rank runs ``layer`` (pipeline parallelism leaves the others empty)."""
    return type(layer).__name__ != "PPMissingLayer"


def taps_of(model: torch.nn.Module) -> dict[torch.nn.Module, Tap]:
    """The taps this loader put on ``model`` (none: it was loaded eager, without them)."""
    return _TAPS.get(model, {})


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
        # Q/K capture reads the rotated query and key where vLLM's Attention takes them
        attention = [a for a in (find_attention(layer) for layer in mine) if a is not None]
        taps.update(install_taps(attention, inputs=True))
        _TAPS[model] = taps
        return model


__all__ = ["LOAD_FORMAT", "MillmModelLoader", "find_attention", "find_layers", "held", "taps_of"]
