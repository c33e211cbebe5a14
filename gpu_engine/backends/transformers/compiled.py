"""Compiled decoding (TORCH_COMPILE, TORCH_COMPILE_MODE) and the static KV cache
(KV_CACHE_MODE) of the transformers backend.

What is compiled: the one-token decode step, serial and batched — the model's forward
through ``torch.compile`` (inductor; on the CPU with ``freezing``, so that its linear
layers run from oneDNN-packed weights as the eager model's ``cpu_kernels`` do: inductor
cannot lower our own ``PackedLinear``, so a compiled CPU model is loaded unpacked).
Prefills, embeddings, scoring and speculative verification stay eager.  Cost of
freezing: each graph holds its own packed copy of the weights it reads, so memory grows
by up to one model per shape compiled (row bucket, static cache length).

Hooks are never silently skipped.  Steering and monitoring are forward hooks whose state
lives in Python (``gpu_engine.interp.hooks``), so the hook itself is excluded from the graph
(``torch.compiler.disable``: a graph break at each hooked block, the hook runs as
written) and Dynamo's nn-module hook guards are on
(``torch._dynamo.config.skip_nnmodule_hook_guards = False``): a hook installed or removed
after compilation fails the guards and the step recompiles with it.  Past a hook's graph
break Dynamo compiles every later decoder layer's call as a frame of its own (one graph
per layer and shape).  The attach and
detach path also resets the compile cache (``reset``), so the graphs of earlier hook sets
are dropped rather than kept until the recompile limit.  A step with a capture or an
attention tap armed (per request) runs eagerly instead of recompiling per request.

Shapes are fixed between recompiles, so the step does not recompile as sequences grow:
the serial path decodes into a ``StaticCache`` whose length is a power-of-two bucket
(``static_length``); the batched path steps its slab cache over its whole capacity with
the rows padded to a power-of-two bucket (``kv_cache.BatchKVCache`` in fixed mode), so a
request joining or leaving recompiles only when the bucket or the slab's capacity changes
— at most a few times per doubling.  ``compiles`` counts every graph the backend compiled
(recompiles included) since the model loaded; it is in the backend's capabilities and in
the ``millm_torch_compile_graphs_total`` metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...api.errors import InvalidParameter

log = logging.getLogger("gpu_engine.transformers")

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
KV_CACHE_MODES = ("dynamic", "static")
DEFAULT_COMPILE_MODE = "reduce-overhead"
# smallest static cache of the serial path; larger ones double
MIN_STATIC_LENGTH = 256
# graphs Dynamo keeps per code object before it runs that code eagerly.  Past a hook's
# graph break Dynamo compiles each later decoder layer's call as a frame of its own,
# specialised on the layer's index, so one code object holds a graph per layer per row
# bucket: room for a 32-layer model at 8 shapes
RECOMPILE_LIMIT = 256
ACCUMULATED_RECOMPILE_LIMIT = 2048


def compile_wanted(option: bool | None, device: torch.device, *, speculative: bool = False) -> bool:
    """TORCH_COMPILE: true / false, or unset (auto): compile on CUDA, not on the CPU
    (docs/performance.md, "Compiled decoding": it did not pay on the CPU), and not when
    the model decodes speculatively (that runs eagerly)."""
    if option is None:
        return device.type == "cuda" and not speculative
    return bool(option)


def decode_options(options: Mapping[str, Any]) -> tuple[bool | None, str, str]:
    """(torch_compile, torch_compile_mode, kv_cache_mode) of a load job, checked."""
    compile_opt = options.get("torch_compile")
    mode = options.get("torch_compile_mode", DEFAULT_COMPILE_MODE)
    kv = options.get("kv_cache_mode", "dynamic")
    if mode not in COMPILE_MODES:
        raise InvalidParameter(
            f"torch_compile_mode must be one of {', '.join(COMPILE_MODES)}",
            param="options.torch_compile_mode",
        )
    if kv not in KV_CACHE_MODES:
        raise InvalidParameter(
            f"kv_cache_mode must be one of {', '.join(KV_CACHE_MODES)}",
            param="options.kv_cache_mode",
        )
    if options.get("speculative_model") and (compile_opt or kv == "static"):
        # speculative decoding crops a DynamicCache and verifies several tokens a forward
        raise InvalidParameter(
            "speculative decoding needs an eager model with the dynamic KV cache",
            param="options.speculative_model",
        )
    return compile_opt, mode, kv


def static_length(needed: int, context_length: int) -> int:
    """The serial path's StaticCache length for ``needed`` positions: a power of two from
    MIN_STATIC_LENGTH, at most the context window (but never below ``needed``)."""
    length = MIN_STATIC_LENGTH
    while length < needed:
        length *= 2
    return max(min(length, context_length), needed)


class _CountingBackend:
    """Inductor, counting the graphs it compiles."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiles += 1
        return self.inner(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ...
        return getattr(self.inner, name)


class CompiledDecode:
    """The compiled decode forwards of one loaded model (see the module doc)."""

    def __init__(self, model: torch.nn.Module, *, mode: str, device: torch.device) -> None:
        import torch._dynamo

        torch._dynamo.config.skip_nnmodule_hook_guards = False
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, ACCUMULATED_RECOMPILE_LIMIT)
        self.mode = mode
        # on the CPU, freezing turns the weights into constants inductor packs for oneDNN
        options = {"freezing": True} if device.type == "cpu" else None
        self.backend = _CountingBackend(torch._TorchCompileInductorWrapper(mode, options, False))
        self.cache_resets = 0
        self.model = model
        self.serial: Callable[..., Any] = torch.compile(self._serial, backend=self.backend, dynamic=False)
        self.rows: Callable[..., Any] = torch.compile(self._rows, backend=self.backend, dynamic=False)

    def _serial(self, input_ids: torch.Tensor, past: Any, cache_position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            past_key_values=past,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits

    def _rows(
        self,
        input_ids: torch.Tensor,
        past: Any,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_position: torch.Tensor,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            past_key_values=past,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits

    def reset(self) -> None:
        """Drop every compiled graph (the attach/detach path): the next step recompiles
        with the hooks installed now."""
        import torch._dynamo

        torch._dynamo.reset()
        self.cache_resets += 1

    @property
    def compiles(self) -> int:
        return self.backend.compiles

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "compiles": self.compiles, "cache_resets": self.cache_resets}


__all__ = [
    "COMPILE_MODES",
    "KV_CACHE_MODES",
    "CompiledDecode",
    "compile_wanted",
    "decode_options",
    "static_length",
]
