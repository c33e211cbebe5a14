"""Graph-safe hook sites: a module's forward hooks run by one registered op the compiled
graph keeps.

A compiler that traces a model once (vLLM's ``torch.compile`` with its guards dropped,
CUDA graph capture) never sees a Python hook added to a module after the trace: the hook
silently stops running.  A ``Tap`` is installed on a module **before** the model is
compiled; its forward hook calls ``torch.ops.millm.tap(hidden, residual, site)``, an op
opaque to the compiler that declares it writes ``hidden``, so the graph keeps the call,
in order, at every forward.  The op's body runs in Python at each call: it runs the
hooks added to the tap since (``HookManager`` adds the steering, monitoring and capture
hooks there instead of on the module), and writes what they return back into ``hidden``.
With no hook added, a call costs one dispatch and returns.

Under piecewise CUDA graphs the op must be one of the compiler's splitting ops (vLLM's
``compilation_config.splitting_ops``): the graph is cut around it and the op runs eagerly
between the captured pieces (``gpu_engine.backends.vllm.backend``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

# site id -> its tap (an int is what a compiled graph can carry to the op)
_SITES: dict[int, Tap] = {}
_NEXT_SITE = itertools.count(1)

OP_NAME = "millm::tap"


@torch.library.custom_op(OP_NAME, mutates_args=("hidden",))
def _tap(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    tap = _SITES.get(site)
    if tap is not None and tap.hooks:
        tap.run(hidden, residual)


@_tap.register_fake
def _tap_fake(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    return None


class TapHandle:
    """What ``Tap.add`` returns: ``remove()`` takes the hook off, as a module hook's
    handle does."""

    def __init__(self, tap: Tap, key: int) -> None:
        self.tap = tap
        self.key = key

    def remove(self) -> None:
        self.tap.hooks.pop(self.key, None)


class Tap:
    """One module's graph-safe hook site.  ``residual_pair``: the module returns
    ``(hidden, residual)`` (vLLM's decoder layers); the hooks see that pair, and only
    ``hidden`` may change (steering adds to it; the sum changes once).  ``inputs``: the
    site is the module's first two inputs instead (``query`` and ``key`` of vLLM's
    ``Attention``), and its hooks are forward pre-hooks that read them and change nothing.
    ``with_input``: an output site whose hooks also see the module's first input as their
    ``args`` (a transcoder reads the MLP's input and writes its output)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        residual_pair: bool = False,
        inputs: bool = False,
        with_input: bool = False,
    ) -> None:
        self.module = module
        self.residual_pair = residual_pair
        self.inputs = inputs
        self.with_input = with_input
        self.site = next(_NEXT_SITE)
        self.hooks: dict[int, Callable[..., Any]] = {}
        self._keys = itertools.count()
        _SITES[self.site] = self
        if inputs:
            self._handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)
        elif with_input:
            self._handle = module.register_forward_hook(self._forward_with_input, with_kwargs=True)
        else:
            self._handle = module.register_forward_hook(self._forward)

    def _forward_with_input(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        first = args[0] if len(args) > 0 else next(iter(kwargs.values()))
        torch.ops.millm.tap(output[0] if isinstance(output, tuple) else output, first, self.site)
        return output

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.residual_pair:
            torch.ops.millm.tap(output[0], output[1], self.site)
        else:
            torch.ops.millm.tap(output[0] if isinstance(output, tuple) else output, None, self.site)
        return output

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        first = args[0] if len(args) > 0 else kwargs["query"]
        second = args[1] if len(args) > 1 else kwargs["key"]
        torch.ops.millm.tap(first, second, self.site)
        return None

    def add(self, hook: Callable[..., Any]) -> TapHandle:
        """Run ``hook`` at each forward, after those added before: ``hook(module, (),
        output)`` on an output site (``hook(module, (input,), output)`` with
        ``with_input``), ``hook(module, (first, second), {})`` on an input one."""
        key = next(self._keys)
        self.hooks[key] = hook
        return TapHandle(self, key)

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if self.inputs:
            for hook in list(self.hooks.values()):
                hook(self.module, (hidden, residual), {})
            return
        output: Any = (hidden, residual) if self.residual_pair else hidden
        # an output site with its input: the op's second tensor is the module's input
        args = (residual,) if self.with_input else ()
        for hook in list(self.hooks.values()):
            new = hook(self.module, args, output)
            if new is not None:
                output = new
        result = output[0] if isinstance(output, tuple) else output
        if result is not hidden:
            hidden.copy_(result)

    def close(self) -> None:
        self._handle.remove()
        self.hooks.clear()
        _SITES.pop(self.site, None)


def install_taps(
    modules: list[torch.nn.Module], *, residual_pair: bool = False, inputs: bool = False, with_input: bool = False
) -> dict[torch.nn.Module, Tap]:
    """A tap on each of ``modules`` (before the model is compiled), keyed by module."""
    return {m: Tap(m, residual_pair=residual_pair, inputs=inputs, with_input=with_input) for m in modules}


__all__ = ["OP_NAME", "Tap", "TapHandle", "install_taps"]
