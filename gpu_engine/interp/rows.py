"""The one row router: which token row of a forward belongs to which request, and what
each attachment adds to it.

Every running request holds a slot.  Per attachment that someone steers, a delta table
(slots, d) holds each request's delta in its slot (zero rows for the others); per
attachment with feature controls, one ``ControlTable`` concatenates the members' tables,
each in its own column range (``AttachmentPlan.cols``) and tagged with its slot.  A table
lives while somebody steers at its attachment.

A forward is described by its parts, ``(row, row_start, row_end, start_position)`` in row
order covering the forward's rows; ``context`` turns them into the ``BatchContext`` the
hooks read: ``row_slots`` (one gather per table), ``row_positions`` (only where control
tables exist: phases, windows and gates read them) and the segments of the requests that
monitor, keep gates or capture.  A part may start at a negative position: those rows are
padding (a left-padded prefill) — they take the request's slot but no gate opens there
and no monitor or capture reads them.  After the forward, ``count`` turns the attachments
the hooks really added (``BatchContext.applied``) into each request's counts.

The transformers batch, vLLM's workers and llama.cpp's runner all route through this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..api.protocol import AttachmentKey
from .controls import ControlTable
from .hooks import BatchContext, RequestHooks, Segment

# a growing router's first size (then doubling)
FIRST_CAPACITY = 16


class Row:
    """A request as the router holds it: its slot, the attachments whose delta table
    (``deltas``) and control table (``controls``) hold it, and whether its rows go to the
    hooks as a segment (``watched``: monitors, conditional controls or a capture)."""

    __slots__ = ("controls", "deltas", "hooks", "keys", "slot", "watched")

    def __init__(self, hooks: RequestHooks | None, slot: int) -> None:
        self.hooks = hooks
        self.slot = slot
        self.deltas: list[AttachmentKey] = []
        self.controls: list[AttachmentKey] = []
        self.keys: tuple[AttachmentKey, ...] = ()  # deltas and controls, once each
        self.watched = hooks is not None and bool(hooks.monitors() or hooks.conditional or hooks.capture is not None)


class RowRouter:
    """Slots and per-attachment tables for the requests of one batch.

    ``max_rows``: a fixed number of slots (the transformers batch, llama.cpp's sequences);
    a request beyond them is refused (the scheduler never admits one).  Without it the
    router grows, doubling, as requests arrive (vLLM's workers, which do not know how many
    requests vLLM will run at once); the tables grow with it."""

    def __init__(self, *, device: torch.device | str, max_rows: int | None = None) -> None:
        self.device = torch.device(device)
        self.fixed = max_rows is not None
        self.capacity = 0
        self._free: list[int] = []
        self.tables: dict[AttachmentKey, torch.Tensor] = {}
        self.control_tables: dict[AttachmentKey, ControlTable] = {}
        self._steered: dict[AttachmentKey, list[Row]] = {}
        self._controlled: dict[AttachmentKey, list[Row]] = {}
        self._live: dict[int, Row] = {}  # slot -> its request
        self._size(max_rows if max_rows is not None else 0)

    def _size(self, capacity: int) -> None:
        old = self.capacity
        self.capacity = capacity
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free
        for key, table in self.tables.items():
            grown = torch.zeros((capacity, table.shape[1]), dtype=table.dtype, device=table.device)
            grown[:old] = table
            self.tables[key] = grown

    # ------------------------------------------------------------------ requests

    def add(self, hooks: RequestHooks | None) -> Row:
        """A slot for the request and its steering in the tables of its attachments."""
        if not self._free:
            if self.fixed:
                raise RuntimeError("the batch is full")  # the scheduler never lets this happen
            self._size(max(FIRST_CAPACITY, self.capacity * 2))
        row = Row(hooks, self._free.pop())
        self._live[row.slot] = row
        for key, plan in hooks.plans.items() if hooks is not None else ():
            if plan.controls is not None:
                self._controlled.setdefault(key, []).append(row)
                row.controls.append(key)
                self._rebuild_controls(key)
            if plan.delta is None:
                continue
            table = self.tables.get(key)
            if table is None:
                table = torch.zeros((self.capacity, plan.delta.shape[-1]), dtype=plan.delta.dtype, device=self.device)
                self.tables[key] = table
                self._steered[key] = []
            table[row.slot] = plan.delta
            self._steered[key].append(row)
            row.deltas.append(key)
        row.keys = tuple(dict.fromkeys((*row.deltas, *row.controls)))
        return row

    def remove(self, row: Row) -> None:
        """The request's rows leave its tables (a table nobody steers at is dropped, so
        the hook skips that attachment entirely) and its slot is free again."""
        if row.slot < 0:
            return
        for key in row.deltas:
            rows = self._steered.get(key)
            if rows is None:  # the attachment went (``forget``)
                continue
            rows.remove(row)
            if rows:
                self.tables[key][row.slot].zero_()
            else:
                del self._steered[key], self.tables[key]
        for key in row.controls:
            members = self._controlled.get(key)
            if members is not None:
                members.remove(row)
                self._rebuild_controls(key)
        row.deltas, row.controls, row.keys = [], [], ()
        del self._live[row.slot]
        self._free.append(row.slot)
        row.slot = -1

    def forget(self, key: AttachmentKey) -> None:
        """An attachment detached: its tables go whoever still names it."""
        self.tables.pop(key, None)
        self._steered.pop(key, None)
        self.control_tables.pop(key, None)
        self._controlled.pop(key, None)

    def reset(self) -> None:
        """Every slot free, every table gone (a failed step, a batch thrown away)."""
        for row in self._live.values():
            row.slot = -1
            row.deltas, row.controls, row.keys = [], [], ()
        self._live.clear()
        self.tables.clear()
        self._steered.clear()
        self.control_tables.clear()
        self._controlled.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def _rebuild_controls(self, key: AttachmentKey) -> None:
        """The batch table of ``key``'s controls: each member's operations in a column
        range of their own (``plan.cols``), tagged with its slot."""
        members = self._controlled.get(key)
        if not members:
            self._controlled.pop(key, None)
            self.control_tables.pop(key, None)
            return
        col = 0
        parts = []
        for row in members:
            plan = row.hooks.plans[key]  # type: ignore[union-attr]
            parts.append((plan.controls, row.slot))
            plan.cols = (col, col + plan.controls.size)  # type: ignore[union-attr]
            col = plan.cols[1]
        self.control_tables[key] = ControlTable.concat(parts)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ forwards

    def row_slots(self, parts: Sequence[tuple[Row, int, int, int]]) -> torch.Tensor:
        """Every row's slot (a caller whose batch did not change keeps this)."""
        slots = np.fromiter((r.slot for r, *_ in parts), dtype=np.int64, count=len(parts))
        counts = np.fromiter((b - a for _, a, b, _ in parts), dtype=np.int64, count=len(parts))
        return torch.from_numpy(np.repeat(slots, counts)).to(self.device)

    def context(
        self,
        parts: Sequence[tuple[Row, int, int, int]],
        *,
        row_slots: torch.Tensor | None = None,
        only_present: bool = False,
        capture_stage: torch.Tensor | None = None,
        qk_stage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> BatchContext:
        """The ``BatchContext`` of one forward of ``parts``.  ``only_present``: hand the
        hooks only the tables of attachments this forward's requests steer (vLLM runs
        fewer requests in a forward than its workers hold; an attachment nobody in the
        forward steers must not count as applied)."""
        tables, controls = self.tables, self.control_tables
        if only_present and (tables or controls):
            keys = {k for r, *_ in parts for k in r.keys}
            tables = {k: t for k, t in tables.items() if k in keys}
            controls = {k: t for k, t in controls.items() if k in keys}
        positions = None
        if controls:
            # padding rows (negative positions) stay negative: no phase or window opens there
            offsets = np.fromiter((pos - a for _, a, _, pos in parts), dtype=np.int64, count=len(parts))
            counts = np.fromiter((b - a for _, a, b, _ in parts), dtype=np.int64, count=len(parts))
            n = int(counts.sum())
            positions = torch.from_numpy(np.arange(n, dtype=np.int64) + np.repeat(offsets, counts)).to(self.device)
        segments = [
            Segment(r.hooks, a - min(pos, 0), b, max(pos, 0))  # type: ignore[arg-type]
            for r, a, b, pos in parts
            if r.watched
        ]
        return BatchContext(
            segments,
            row_slots=row_slots if row_slots is not None else self.row_slots(parts),
            delta_tables=tables,
            control_tables=controls,
            row_positions=positions,
            capture_stage=capture_stage,
            qk_stage=qk_stage,
        )

    @staticmethod
    def count(rows: Iterable[Row], applied: set[AttachmentKey]) -> None:
        """+1 for each request whose steering the hooks really added in this forward at
        an attachment in ``applied`` (a hook a compiler skipped shows as a count below
        the request's forward passes)."""
        if not applied:
            return
        for row in rows:
            for key in row.keys:
                if key in applied:
                    row.hooks.plans[key].applied()  # type: ignore[union-attr]


__all__ = ["Row", "RowRouter"]
