"""Where capture reads the model: the forward hook on a block (``CaptureHook``, and
``is_pair`` for blocks that return ``(hidden, residual)``), the attention taps' routing
of Q/K rows (``route_qk``) and arming a plan's layers for one request (``armed``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .plan import CapturePlan


def is_pair(output: Any) -> bool:
    """Whether a block returned ``(hidden, residual)`` (vLLM's Llama-family layers) rather
    than the stream itself (vLLM's GPT-2 blocks add their residual inside): a hook
    installed with ``residual_pair`` on a block of the other kind treats it as a plain
    block."""
    return (
        isinstance(output, tuple)
        and len(output) >= 2
        and isinstance(output[1], torch.Tensor)
        and output[1].shape == output[0].shape
    )


class CaptureHook:
    """The forward hook on one block while a capture of it is armed; reads the manager's
    current ``BatchContext`` and never changes the output.  ``residual_pair``: the block
    returns ``(hidden, residual)`` (vLLM's decoder layers) and the stream is their sum."""

    def __init__(self, layer: int, manager: Any, *, residual_pair: bool = False) -> None:
        self.layer = layer
        self.manager = manager
        self.residual_pair = residual_pair

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx = self.manager.current
        if ctx is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        stage = ctx.capture_stage
        if stage is None and not any(
            s.request.capture is not None and self.layer in s.request.capture.index for s in ctx.segments
        ):
            return None
        if self.residual_pair and is_pair(output):
            hidden = hidden + output[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if stage is not None:  # batched decode: every row into its slot, one copy
            slots = ctx.row_slots
            stage[self.layer].index_copy_(0, slots, flat[: slots.shape[0]])
            return None
        for seg in ctx.segments:
            plan = seg.request.capture
            if plan is not None and self.layer in plan.index:
                plan.observe(self.layer, flat[seg.row_start : seg.row_end], seg.start_position)
        return None


def route_qk(ctx: Any, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
    """Layer ``layer``'s rotated queries (rows, heads, head_dim) and new keys (rows,
    kv_heads, head_dim), rows in the batch's flattened order, to the requests capturing
    them: every row into its slot of the batch's stage (batched decode), else each
    capturing request's segment into its plan.  The attention taps of every backend call
    this."""
    stage = ctx.qk_stage
    if stage is not None:
        slots = ctx.row_slots
        n = slots.shape[0]
        stage[0][layer].index_copy_(0, slots, q[:n])
        stage[1][layer].index_copy_(0, slots, k[:n])
        return
    for seg in ctx.segments:
        plan = seg.request.capture
        if plan is not None and plan.wants_qk(layer):
            plan.observe_qk(layer, q[seg.row_start : seg.row_end], k[seg.row_start : seg.row_end], seg.start_position)


@contextmanager
def armed(manager: Any, runner: Any, plan: CapturePlan | None) -> Iterator[None]:
    """The plan's layers armed on ``manager`` (``HookManager``) — block hooks for hidden
    states, attention taps for Q/K (``runner.arm_qk``) — and disarmed on the way out
    whatever happens (the serial path: one request at a time)."""
    done: list[int] = []
    done_qk: list[int] = []
    try:
        for layer in plan.layers if plan is not None else ():
            manager.arm_capture(layer, runner.block(layer)[0])
            done.append(layer)
        for layer in plan.qk_layers if plan is not None else ():
            runner.arm_qk(layer)
            done_qk.append(layer)
        yield
    finally:
        for layer in done:
            manager.disarm_capture(layer)
        for layer in done_qk:
            runner.disarm_qk(layer)
