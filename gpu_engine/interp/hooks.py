"""Forward hooks for steering and monitoring, driven by a per-forward batch context.

One hook is installed per attached (sae_id, layer), on the output of that decoder block
(the residual stream after it).  The hook holds no request state: before each forward
pass the runner publishes a ``BatchContext`` saying which token rows belong to which
request and at which sequence position they start; the hook looks up that request's
precomputed plan (steering delta, monitors) for its attachment.  With no context
published (embeddings, scoring, an idle engine) the hook returns at once.

The serial backend (and the batch scheduler's per-request prefill) publishes one segment
per forward and the hook adds that request's delta as one broadcast vector.  A batched
decode step publishes ``row_slots`` — the delta-table slot of every token row — and, per
attachment, a table with each running request's delta in its slot (zeros for unsteered
requests); the hook adds ``table[row_slots]`` (one gather, no loop over requests) and
records that it did, and monitors read only the rows of the requests that asked.

Blocks that return ``(hidden, residual)`` (vLLM's Llama-family layers, which defer the residual
add to the next layer's fused norm) are installed with ``residual_pair=True``: the
residual stream a user means is ``hidden + residual``, so monitors read that sum and the
delta is added to ``hidden`` only, changing the sum exactly once. A block that returns the
stream itself (vLLM's GPT-2) is read and steered as a plain block (``capture.is_pair``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..api.protocol import (
    ActivationRecord,
    AttachmentKey,
    SteeringCount,
    SteeringFired,
)
from .capture import CaptureHook, is_pair
from .controls import ControlTable
from .monitors import MonitorPlan
from .taps import Tap


@dataclass
class AttachmentPlan:
    """One request's work at one attachment: the delta of its plain adds, its feature
    controls (``ControlTable``; ``cols`` = their columns in the batch's table), its
    monitors, and what was applied (forward passes, per mode, and where conditional
    controls fired)."""

    key: AttachmentKey
    delta: torch.Tensor | None = None
    controls: ControlTable | None = None
    cols: tuple[int, int] = (0, 0)
    pre: list[MonitorPlan] = field(default_factory=list)
    post: list[MonitorPlan] = field(default_factory=list)
    count: int = 0
    mode_counts: dict[str, int] = field(default_factory=dict)
    gates: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def steers(self) -> bool:
        return self.delta is not None or self.controls is not None

    @property
    def conditional(self) -> bool:
        return self.controls is not None and self.controls.gated_by_feature

    def applied(self) -> None:
        """One forward pass in which this plan's steering was added (a splice counts as
        mode ``splice``)."""
        self.count += 1
        modes = {"add"} if self.delta is not None else set()
        if self.controls is not None:
            modes.update(self.controls.modes)
            if self.controls.splice_modes:
                modes.add("splice")
        for mode in modes:
            self.mode_counts[mode] = self.mode_counts.get(mode, 0) + 1

    def record_gates(self, start: int, gate: torch.Tensor) -> None:
        """Keep this forward's gate of the conditional controls (rows from ``start``);
        read on the host only when the request finishes."""
        self.gates.append((start, gate))

    def fired(self) -> list[SteeringFired]:
        """Where each conditional control's gate was open (row positions)."""
        table = self.controls
        if table is None or not table.gated_by_feature:
            return []
        positions: list[list[int]] = [[] for _ in range(table.size)]
        for start, gate in self.gates:
            for r, row in enumerate(gate.tolist()):
                for j, open_ in enumerate(row):
                    if open_ and table.conditional[j]:
                        positions[j].append(start + r)
        self.gates.clear()
        return [
            SteeringFired(self.key[0], self.key[1], table.indices[j], table.modes[j], sorted(set(positions[j])))
            for j in range(table.size)
            if table.conditional[j]
        ]


@dataclass
class RequestHooks:
    """A request's plans, keyed by attachment; built once when the request starts."""

    request_id: str
    plans: dict[AttachmentKey, AttachmentPlan] = field(default_factory=dict)
    capture: Any = None  # gpu_engine.interp.capture.CapturePlan

    def monitors(self) -> list[MonitorPlan]:
        return [m for p in self.plans.values() for m in (*p.pre, *p.post)]

    def collect(self) -> list[ActivationRecord]:
        """Records of streaming monitors encoded so far (call once per step)."""
        recs: list[ActivationRecord] = []
        for m in self.monitors():
            if m.stream and m.pending:
                recs.extend(m.collect())
        return recs

    def rewind(self, position: int) -> None:
        """Every monitor forgets the rows at ``position`` or later (``MonitorPlan.rewind``)."""
        for m in self.monitors():
            m.rewind(position)

    def finalize(self) -> list[ActivationRecord]:
        """Encode every buffered row and return all remaining records."""
        recs: list[ActivationRecord] = []
        for m in self.monitors():
            m.flush()
            recs.extend(m.collect())
        return recs

    def steering_counts(self) -> list[SteeringCount]:
        return [SteeringCount(k[0], k[1], p.count, dict(p.mode_counts)) for k, p in self.plans.items() if p.steers]

    @property
    def conditional(self) -> bool:
        return any(p.conditional for p in self.plans.values())

    def steering_fired(self) -> list[SteeringFired]:
        return [f for p in self.plans.values() for f in p.fired()]


@dataclass
class Segment:
    """Token rows ``[row_start, row_end)`` of the flattened hidden states belong to ``request``
    and hold sequence positions ``start_position, start_position + 1, …``."""

    request: RequestHooks
    row_start: int
    row_end: int
    start_position: int


@dataclass
class BatchContext:
    """What the hooks need to know about the forward pass about to run.

    Single-request mode (``row_slots is None``): ``segments`` holds one segment covering
    every row, and the hook applies that request's plan directly (counting it).

    Batched mode: ``row_slots`` (n_rows,) maps each flattened token row to a slot of the
    per-attachment ``delta_tables`` (slots, d); a table exists only for attachments that
    at least one request in the batch steers.  ``segments`` lists only the requests that
    monitor something, with their rows and positions.  The hook adds ``applied`` keys for
    tables it really added; the scheduler turns that into per-request counts.
    """

    segments: list[Segment]
    row_slots: torch.Tensor | None = None
    delta_tables: dict[AttachmentKey, torch.Tensor] = field(default_factory=dict)
    applied: set[AttachmentKey] = field(default_factory=set)
    # batched mode with feature controls: each attachment's batch ``ControlTable`` and
    # every row's sequence position (segments then also list requests with conditional
    # controls, whose gates are kept)
    control_tables: dict[AttachmentKey, ControlTable] = field(default_factory=dict)
    row_positions: torch.Tensor | None = None
    # batched decode with a capture armed: (num_layers, slots, d), every row written to
    # its slot by the capture hooks (gpu_engine.interp.capture)
    capture_stage: torch.Tensor | None = None
    # batched decode with a Q/K capture armed: (q (num_layers, slots, heads, head_dim),
    # k (num_layers, slots, kv_heads, head_dim)), written by the attention taps
    qk_stage: tuple[torch.Tensor, torch.Tensor] | None = None

    def window(self, lo: int, hi: int) -> BatchContext:
        """The context of rows ``[lo, hi)`` of this forward, renumbered from 0: for a
        backend whose node holds a slice of the forward's rows (llama.cpp computes a batch
        in ubatches).  The tables and ``applied`` are shared with this context."""
        if lo == 0 and self.row_slots is not None and hi == self.row_slots.shape[0]:
            return self
        segments = []
        for seg in self.segments:
            a, b = max(seg.row_start, lo), min(seg.row_end, hi)
            if a < b:
                segments.append(Segment(seg.request, a - lo, b - lo, seg.start_position + (a - seg.row_start)))
        return self._rows(segments, slice(lo, hi))

    def select(self, index: list[int]) -> BatchContext:
        """The context of rows ``index`` (ascending) of this forward, renumbered 0, 1, …: a
        node holding only some rows (llama.cpp's last layer keeps the rows that produce
        logits).  A request's picked rows that are not consecutive positions become one
        segment per run."""
        if self.row_slots is not None and len(index) == self.row_slots.shape[0]:
            return self  # every row, in order
        picked = np.asarray(index, dtype=np.int64)
        segments = []
        for seg in self.segments:
            k0, k1 = np.searchsorted(picked, (seg.row_start, seg.row_end))
            if k0 == k1:
                continue
            run = picked[k0:k1]
            cuts = [0, *(np.flatnonzero(np.diff(run) != 1) + 1).tolist(), len(run)]
            for a, b in zip(cuts, cuts[1:]):
                start = seg.start_position + int(run[a]) - seg.row_start
                segments.append(Segment(seg.request, int(k0) + a, int(k0) + b, start))
        rows = torch.from_numpy(picked)
        return self._rows(segments, rows)

    def _rows(self, segments: list[Segment], rows: slice | torch.Tensor) -> BatchContext:
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[rows] if isinstance(rows, slice) else t.index_select(0, rows.to(t.device))

        return BatchContext(
            segments,
            row_slots=take(self.row_slots),
            delta_tables=self.delta_tables,
            applied=self.applied,
            control_tables=self.control_tables,
            row_positions=take(self.row_positions),
        )


@dataclass
class AttachmentStats:
    steering_apply_count: int = 0


class AttachmentHook:
    """The forward hook for one (sae_id, layer); reads the manager's current context."""

    def __init__(
        self,
        key: AttachmentKey,
        manager: HookManager,
        stats: AttachmentStats,
        *,
        residual_pair: bool = False,
        read_input: bool = False,
    ) -> None:
        self.key = key
        self.manager = manager
        self.stats = stats
        self.residual_pair = residual_pair
        # a transcoder reads its module's input and writes its output: monitors (and any
        # encode) read ``args[0]``, the delta still goes into the output
        self.read_input = read_input

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        ctx = self.manager.current
        if ctx is None:
            return None
        is_tuple = isinstance(output, tuple)
        hidden = output[0] if is_tuple else output
        if self.residual_pair and is_pair(output):
            return self._pair(ctx, hidden, output[1], output)
        key = self.key
        segs = ctx.segments
        if ctx.row_slots is None:
            plan = segs[0].request.plans.get(key)
            if plan is None:
                return None
            start = segs[0].start_position
            read = args[0] if self.read_input else hidden
            if plan.pre:
                rows = read.reshape(-1, read.shape[-1])
                for m in plan.pre:
                    m.observe(rows, start)
            new = hidden
            if plan.delta is not None:
                new = hidden + plan.delta
            if plan.controls is not None:
                flat = hidden.reshape(-1, hidden.shape[-1])
                positions = torch.arange(start, start + flat.shape[0], device=plan.controls.lo.device)
                delta, gate = plan.controls.apply(read.reshape(-1, read.shape[-1]), positions, written=flat)
                if plan.conditional:
                    plan.record_gates(start, gate)
                new = new + delta.to(hidden.dtype).view_as(hidden)
                if plan.controls.splice_modes:
                    active, target = plan.controls.splice_rows(read.reshape(-1, read.shape[-1]), positions)
                    flat_new = torch.where(active[:, None], target.to(hidden.dtype), new.reshape(flat.shape))
                    new = flat_new.view_as(hidden)
            if plan.steers:
                plan.applied()
                self.stats.steering_apply_count += 1
            if plan.post:
                after = read if self.read_input else new
                rows = after.reshape(-1, after.shape[-1])
                for m in plan.post:
                    m.observe(rows, start)
        else:
            new = self._batched(ctx, hidden, args[0] if self.read_input else None)
            if new is None:
                return None
        if new is hidden:
            return None
        return (new, *output[1:]) if is_tuple else new

    def _batched(self, ctx: BatchContext, hidden: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor | None:
        flat = hidden.reshape(-1, hidden.shape[-1])
        read = inputs.reshape(-1, inputs.shape[-1]) if inputs is not None else None
        n = ctx.row_slots.shape[0]  # type: ignore[union-attr]
        if flat.shape[0] > n:
            # a fixed-shape step's padding rows (kv_cache.BatchKVCache): left as they are
            new = route(ctx, self.key, self.stats, flat[:n], read=read[:n] if read is not None else None)
            return None if new is None else torch.cat([new, flat[n:]]).view_as(hidden)
        new = route(ctx, self.key, self.stats, flat, read=read)
        return None if new is None else new.view_as(hidden)

    def _pair(self, ctx: BatchContext, hidden: torch.Tensor, residual: torch.Tensor, output: tuple) -> Any:
        """Batched mode for a block returning ``(hidden, residual)``: monitors and controls
        read the sum, the delta goes into ``hidden`` alone (the sum changes once)."""
        n = ctx.row_slots.shape[0] if ctx.row_slots is not None else hidden.shape[0]
        if hidden.shape[0] > n:
            # rows past the batch's tokens (padding) keep their values
            new = route(ctx, self.key, self.stats, hidden[:n], rest=residual[:n])
            return None if new is None else (torch.cat([new, hidden[n:]]), *output[1:])
        new = route(ctx, self.key, self.stats, hidden, rest=residual)
        return None if new is None else (new, *output[1:])


def route(
    ctx: BatchContext,
    key: AttachmentKey,
    stats: AttachmentStats,
    rows: torch.Tensor,
    *,
    read: torch.Tensor | None = None,
    rest: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One attachment's work on the rows of a batched forward, for any backend that can
    hand over a view of them.  ``rows`` (n, d) are what the steering is added to (row i
    is ``ctx``'s row i); the residual stream there is ``rows + rest`` (a block that defers
    its residual add) or ``rows``; monitors and controls read ``read`` instead where it is
    given (a transcoder's input).

    Pre-steering monitors read the stream; each row gets its own request's delta (one
    gather) and feature controls (one masked pass over every request's controls, which
    read the stream before this attachment's steering); the gates of conditional controls
    are kept; a splicing request's rows are replaced (``ControlTable.splice_rows``);
    post-steering monitors read the steered stream.  Returns the steered rows,
    or None where nothing at ``key`` steers in this forward (the rows are unchanged).  The
    transformers hooks, vLLM's workers and llama.cpp's eval callback all steer here."""
    table = ctx.delta_tables.get(key)
    controls = ctx.control_tables.get(key)
    monitored = [(s, p) for s in ctx.segments if (p := s.request.plans.get(key)) is not None and (p.pre or p.post)]
    if table is None and controls is None and not monitored:
        return None
    # the stream's values are needed only by monitors and controls (a plain add needs none)
    stream = rows if rest is None or (controls is None and not monitored) else rows + rest
    src = read if read is not None else stream
    for seg, plan in monitored:
        for m in plan.pre:
            m.observe(src[seg.row_start : seg.row_end], seg.start_position)
    new = rows
    if table is not None:
        # each row gets its own request's delta (zeros for unsteered requests)
        new = new + table.index_select(0, ctx.row_slots)  # type: ignore[arg-type]
    if controls is not None:
        # every row computes every request's controls, masked by slot: one pass
        delta, gate = controls.apply(src, ctx.row_positions, ctx.row_slots, written=stream)  # type: ignore[arg-type]
        new = new + delta.to(new.dtype)
        for seg in ctx.segments:
            plan = seg.request.plans.get(key)
            if plan is not None and plan.conditional:
                plan.record_gates(seg.start_position, gate[seg.row_start : seg.row_end, plan.cols[0] : plan.cols[1]])
        if controls.splice_modes:
            # the splicing requests' rows replaced: the stream there becomes the target
            # exactly (a pair's ``hidden`` becomes ``target - residual``)
            active, target = controls.splice_rows(src, ctx.row_positions, ctx.row_slots)  # type: ignore[arg-type]
            if rest is not None:
                target = target - rest.to(target.dtype)
            new = torch.where(active[:, None], target.to(new.dtype), new)
    if table is not None or controls is not None:
        ctx.applied.add(key)
        stats.steering_apply_count += 1
    if any(p.post for _, p in monitored):
        after = read if read is not None else (new if rest is None else new + rest)
        for seg, plan in monitored:
            for m in plan.post:
                m.observe(after[seg.row_start : seg.row_end], seg.start_position)
    return None if new is rows else new


class HookManager:
    """Owns every installed hook handle; ``remove``/``remove_all`` are the only ways out.
    ``taps``: modules that carry a graph-safe hook site (``interp.taps``, a model compiled
    once); a hook on one of them is added to its tap, not to the module."""

    def __init__(self, taps: Mapping[torch.nn.Module, Tap] | None = None) -> None:
        self.current: BatchContext | None = None
        self.taps: Mapping[torch.nn.Module, Tap] = taps or {}
        self._handles: dict[AttachmentKey, Any] = {}
        self._captures: dict[int, list[Any]] = {}  # layer -> [handle, module, references, residual_pair]

    def register(self, module: torch.nn.Module, hook: Any, *, pre: bool = False) -> Any:
        """``hook`` on ``module`` (a forward hook, or with ``pre`` a forward pre-hook taking
        kwargs), through its tap where it has one (a hook added to a compiled module would
        not run); returns the handle whose ``remove()`` takes it off."""
        tap = self.taps.get(module)
        if tap is not None:
            return tap.add(hook)
        return module.register_forward_pre_hook(hook, with_kwargs=True) if pre else module.register_forward_hook(hook)

    def install(
        self,
        key: AttachmentKey,
        module: torch.nn.Module,
        stats: AttachmentStats,
        *,
        residual_pair: bool = False,
        read_input: bool = False,
        graph_break: bool = False,
    ) -> None:
        """``graph_break``: the model runs compiled (backends/transformers/compiled.py); the
        hook is kept out of the graph and runs as written, at a graph break."""
        if key in self._handles:
            raise RuntimeError(f"a hook for {key} is already installed")
        hook: Any = AttachmentHook(key, self, stats, residual_pair=residual_pair, read_input=read_input)
        if graph_break:
            hook = torch.compiler.disable(hook)
        self._handles[key] = self.register(module, hook)
        for layer, entry in self._captures.items():
            if entry[1] is module:  # a capture reads what the next layer sees: stay last
                entry[0].remove()
                entry[0] = self.register(module, CaptureHook(layer, self, residual_pair=entry[3]))

    def arm_capture(self, layer: int, module: torch.nn.Module, *, residual_pair: bool = False) -> None:
        """A capture hook on block ``layer`` while some request captures it (counted), the
        last hook on its module; no hook at all otherwise.  ``residual_pair``: the block
        returns ``(hidden, residual)`` and the hook reads their sum."""
        entry = self._captures.get(layer)
        if entry is not None:
            entry[2] += 1
            return
        hook = CaptureHook(layer, self, residual_pair=residual_pair)
        self._captures[layer] = [self.register(module, hook), module, 1, residual_pair]

    def disarm_capture(self, layer: int) -> None:
        entry = self._captures.get(layer)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            entry[0].remove()
            del self._captures[layer]

    def armed_captures(self) -> list[int]:
        return sorted(self._captures)

    def remove(self, key: AttachmentKey) -> None:
        handle = self._handles.pop(key, None)
        if handle is not None:
            handle.remove()

    def remove_all(self) -> None:
        for key in list(self._handles):
            self.remove(key)

    def installed(self) -> list[AttachmentKey]:
        return list(self._handles)

    @contextmanager
    def active(self, ctx: BatchContext | None) -> Iterator[None]:
        prev = self.current
        self.current = ctx
        try:
            yield
        finally:
            self.current = prev

    def suppressed(self):  # type: ignore[no-untyped-def]
        """Hooks see no context: embeddings and scoring are never steered or monitored."""
        return self.active(None)


__all__ = [
    "AttachmentHook",
    "AttachmentPlan",
    "AttachmentStats",
    "BatchContext",
    "HookManager",
    "RequestHooks",
    "Segment",
    "route",
]
