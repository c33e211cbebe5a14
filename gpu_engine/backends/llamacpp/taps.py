"""Steering and monitoring inside ``llama_decode``, through the context's eval callback.

llama.cpp names each layer's output ``l_out-{il}`` (the residual stream after block
``il``, after any control vector): the same point the transformers backend hooks.  The
scheduler asks the callback about every graph node (``ask=True``); for a node we claim
it computes the graph up to that node and calls again (``ask=False``) before any later
node runs, so rows written there are what the next layer reads.

Before each decode the batch runner publishes a ``ForwardPlan``: per layer, the rows'
steering deltas (one row per batch token, zeros for unsteered requests) and the
monitored segments.  The callback adds the deltas in place (per request inside one
multi-sequence batch) and hands monitors a torch view of the rows, as the transformers
hook does.  With no plan published the callback claims nothing and costs one Python
call per graph node — or none at all with the C filter (``shim.py``), which answers
llama.cpp's per-node questions without entering Python.

Rows: llama.cpp splits a batch into ubatches in order (one KV stream: ``split_simple``),
so the callback keeps a per-layer row offset.  The last layer's output only holds the
rows that produce logits (llama.cpp drops the others before the last block's FFN), so
its rows map to the batch's output tokens instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llama_cpp.llama_cpp as lc
import numpy as np
import torch

from ...hooks import MonitorPlan
from ...protocol import AttachmentKey
from .native import GGML_BASE, GGML_TYPE_F32, NAME_OFFSET, GGMLTensor
from .shim import TAP_FN, Filter, load_filter


@dataclass
class MonitorSegment:
    """Batch tokens [start, end) of one request, at sequence positions from ``position``."""

    monitors: list[MonitorPlan]
    start: int
    end: int
    position: int
    pre: bool


@dataclass
class LayerPlan:
    # (n_tokens, d) float32 deltas added to the layer's output rows, or None
    deltas: torch.Tensor | None = None
    keys: set[AttachmentKey] = field(default_factory=set)
    segments: list[MonitorSegment] = field(default_factory=list)


@dataclass
class ForwardPlan:
    layers: dict[int, LayerPlan]
    n_tokens: int
    output_rows: list[int]  # batch indices with logits, in order (the last layer's rows)
    applied: set[AttachmentKey] = field(default_factory=set)


class EvalTaps:
    """The eval callback object; one per context (it must outlive the context)."""

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.names = {f"l_out-{il}".encode(): il for il in range(n_layer)}
        self.plan: ForwardPlan | None = None
        self._offsets: dict[int, int] = {}
        self._error: BaseException | None = None
        lib = load_filter()
        self.native_filter = lib is not None
        if lib is not None:
            # the C filter answers every "ask"; Python runs once per hooked layer output
            self.filter = Filter()
            self.filter.n_layer = n_layer
            self.filter.name_offset = NAME_OFFSET
            self._tap_fn = TAP_FN(self._tap)
            self.filter.tap = self._tap_fn
            self._lib = lib
            address = ctypes.cast(lib.millm_eval_filter, ctypes.c_void_p).value
            self.callback = lc.ggml_backend_sched_eval_callback(address)
            self.user_data = ctypes.addressof(self.filter)
        else:
            self.callback = lc.ggml_backend_sched_eval_callback(self._cb)
            self.user_data = None

    def run(self, plan: ForwardPlan | None, decode) -> None:  # type: ignore[no-untyped-def]
        """``decode()`` with ``plan`` published; re-raises what the callback hit."""
        self.plan = plan if plan is not None and plan.layers else None
        self._offsets = {}
        self._error = None
        if self.native_filter and self.plan is not None:
            for il in self.plan.layers:
                self.filter.wanted[il] = 1
            self.filter.active = 1
        try:
            decode()
        finally:
            if self.native_filter and self.plan is not None:
                self.filter.active = 0
                for il in self.plan.layers:
                    self.filter.wanted[il] = 0
            self.plan = None
        if self._error is not None:
            raise self._error

    def _tap(self, t: int, il: int) -> bool:
        """A claimed layer output, computed (the C filter's call)."""
        plan = self.plan
        if plan is None or il not in plan.layers:
            return True
        try:
            self._apply(GGMLTensor.from_address(t), il, plan.layers[il], plan)
        except BaseException as exc:  # noqa: BLE001 - raised after llama_decode returns
            self._error = exc
            return False  # stops the graph
        return True

    def _cb(self, t: int, ask: bool, user_data: int) -> bool:
        """The Python callback (no C compiler): every node comes through here."""
        plan = self.plan
        if plan is None:
            return False
        name = ctypes.string_at(t + NAME_OFFSET)
        il = self.names.get(name)
        if il is None or il not in plan.layers:
            return False
        if ask:
            return True
        return self._tap(t, il)

    def _apply(self, tensor: GGMLTensor, il: int, lp: LayerPlan, plan: ForwardPlan) -> None:
        if tensor.type != GGML_TYPE_F32:
            raise RuntimeError(f"layer output {il} is not float32")
        d, n = int(tensor.ne[0]), int(tensor.ne[1])
        # rows are read and written as one dense (n, d) float32 block: refuse anything else
        # rather than touch memory outside the tensor
        if (int(tensor.ne[2]), int(tensor.ne[3])) != (1, 1) or (
            int(tensor.nb[0]), int(tensor.nb[1])) != (4, 4 * d):
            raise RuntimeError(
                f"layer output {il} is not a dense float32 matrix "
                f"(ne {list(tensor.ne)}, nb {list(tensor.nb)})"
            )
        buf = tensor.buffer
        host = GGML_BASE is None or not buf or GGML_BASE.ggml_backend_buffer_is_host(buf)
        if host and not tensor.data:
            raise RuntimeError(f"layer output {il} has no data")
        if host:
            arr = np.ctypeslib.as_array(
                ctypes.cast(tensor.data, ctypes.POINTER(ctypes.c_float)), shape=(n, d)
            )
        else:  # a device buffer: copy out, write back below
            arr = np.empty((n, d), dtype=np.float32)
            GGML_BASE.ggml_backend_tensor_get(ctypes.addressof(tensor), arr.ctypes.data, 0,
                                              arr.nbytes)
        rows = torch.from_numpy(arr)
        last = il == self.n_layer - 1 and n != plan.n_tokens
        if last:
            index = plan.output_rows[self._offsets.get(il, 0) : self._offsets.get(il, 0) + n]
        else:
            lo = self._offsets.get(il, 0)
            index = None
        self._offsets[il] = self._offsets.get(il, 0) + n

        def segment_rows(seg: MonitorSegment) -> tuple[torch.Tensor, int] | None:
            if index is None:
                a, b = max(seg.start, lo), min(seg.end, lo + n)
                if a >= b:
                    return None
                return rows[a - lo : b - lo], seg.position + (a - seg.start)
            picked = [r for r, tok in enumerate(index) if seg.start <= tok < seg.end]
            if not picked:
                return None
            # output rows of one request are its last positions, contiguous
            return rows[picked[0] : picked[-1] + 1], seg.position + (index[picked[0]] - seg.start)

        for seg in lp.segments:
            if seg.pre and (got := segment_rows(seg)) is not None:
                for m in seg.monitors:
                    m.observe(got[0], got[1])
        if lp.deltas is not None:
            if index is None:
                rows += lp.deltas[lo : lo + n]
            else:
                rows += lp.deltas[torch.tensor(index, dtype=torch.long)]
            plan.applied |= lp.keys
        for seg in lp.segments:
            if not seg.pre and (got := segment_rows(seg)) is not None:
                for m in seg.monitors:
                    m.observe(got[0], got[1])
        if not host and lp.deltas is not None:
            GGML_BASE.ggml_backend_tensor_set(ctypes.addressof(tensor), arr.ctypes.data, 0,
                                              arr.nbytes)


__all__ = ["EvalTaps", "ForwardPlan", "LayerPlan", "MonitorSegment"]
