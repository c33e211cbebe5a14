"""What a monitor reads: the rows one ``MonitorEntry`` asks for, encoded with its SAE.

A ``MonitorPlan`` is handed a forward's rows of its request (``observe``) by whatever
steers and monitors there (``hooks.route``, the serial hook, llama.cpp's eval callback,
vLLM's workers); it keeps the rows it was asked for and encodes them, in one batch when
the request finishes unless the entry streams.  A packed entry (``MonitorEntry.packed``)
keeps every non-zero activation of each encoded chunk, extracted on device (one
``nonzero`` and one gather per chunk) and shipped as CSR bytes.  A fidelity entry
(``MonitorEntry.fidelity``) keeps, per encoded chunk, how well the SAE reconstructs each
row (``FidelityStats``: non-zero features, squared error and squared norm per row, the
rows' sum), reduced on device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..api.protocol import (
    ActivationRecord,
    FeatureActivation,
    FidelityStats,
    MonitorEntry,
    PackedRows,
    PositionRange,
)
from ..sae.module import SAE

_INF = math.inf
FLUSH_CHUNK_ROWS = 256
# a forward of at most this many rows (a decode step, a speculative verification of up to
# 64 drafts) is kept whole by a positions="last" monitor (``MonitorPlan.observe``)
SHORT_FORWARD_ROWS = 65


class MonitorPlan:
    """Encodes the rows one monitor entry asks for.

    By default rows are only copied during decoding and encoded in one batch when the
    request finishes: a top-k over all features needs every encoder column, and reading
    W_enc once per token would cost a few percent of a small model's bandwidth, while one
    batched matmul at the end costs next to nothing.  ``entry.stream`` encodes each step
    instead (records then travel with their token events).  Results stay on device until
    ``collect``, which runs after the step's token sync.
    """

    def __init__(self, entry: MonitorEntry, sae: SAE, *, prompt_len: int) -> None:
        self.entry = entry
        self.sae = sae
        self.prompt_len = prompt_len
        self.top_k = int(entry.top_k)
        self.packed = bool(entry.packed)
        self.fidelity = bool(entry.fidelity)
        self.sel_idx = (
            torch.tensor(entry.features, dtype=torch.long, device=sae.W_enc.device) if entry.features else None
        )
        self.last_only = entry.positions == "last"
        self.stream = bool(entry.stream) and not self.last_only and not self.packed and not self.fidelity
        pos = entry.positions
        if pos == "prompt":
            self.lo, self.hi = 0, prompt_len
        elif pos == "completion":
            self.lo, self.hi = prompt_len - 1, _INF
        elif isinstance(pos, PositionRange):
            self.lo, self.hi = pos.start, (pos.end if pos.end is not None else _INF)
        else:  # "all" / "last"
            self.lo, self.hi = 0, _INF
        self.buffer: list[tuple[int, torch.Tensor]] = []
        self.pending: list[tuple[int, Any, Any, Any]] = []
        # a packed entry's chunks: (first row, rows, per-row counts, feature indices, values)
        self.packed_pending: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # a fidelity entry's chunks: (first row, l0, sq_err, sq_norm per row, the rows' sum)
        self.fidelity_pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # positions below this were observed already: a forward that computes them again
        # (vLLM recomputes a preempted request from position 0, or from its cached prefix)
        # must not record them twice
        self.observed_to = 0

    def observe(self, rows: torch.Tensor, start: int) -> None:
        n = rows.shape[0]
        if self.last_only:
            # a short forward (decode, or a speculative verification) is kept whole, so
            # that rewinding past rejected drafts still leaves the last accepted row
            lo, hi = (start if n <= SHORT_FORWARD_ROWS else start + n - 1), start + n
            self.buffer.clear()
        else:
            lo, hi = max(self.lo, start, self.observed_to), min(self.hi, start + n)
            if lo >= hi:
                return
            self.observed_to = hi
        x = rows[lo - start : hi - start]
        if self.stream:
            self._encode(int(lo), x)
        else:
            self.buffer.append((int(lo), x.clone()))

    def _encode(self, lo: int, x: torch.Tensor) -> None:
        if self.packed:
            self._encode_packed(lo, x)
            return
        if self.fidelity:
            self._encode_fidelity(lo, x)
            return
        top_v = top_i = sel = None
        if self.top_k:
            acts = self.sae.encode(x)
            top = torch.topk(acts, min(self.top_k, self.sae.d_sae), dim=-1)
            top_v, top_i = top.values, top.indices
            if self.sel_idx is not None:
                sel = acts.index_select(-1, self.sel_idx)
        elif self.sel_idx is not None:
            # only the requested encoder columns (all of them for a TopK SAE)
            sel = self.sae.encode_selected(x, self.sel_idx)
        self.pending.append((lo, top_v, top_i, sel))

    def _encode_packed(self, lo: int, x: torch.Tensor) -> None:
        acts = self.sae.encode(x)
        # row-major: rows ascending, then feature indices ascending within a row
        nz = torch.nonzero(acts)
        rows_i, cols = nz[:, 0], nz[:, 1]
        values = acts[rows_i, cols].float()
        counts = torch.bincount(rows_i, minlength=x.shape[0])
        self.packed_pending.append((lo, int(x.shape[0]), counts, cols, values))

    def _encode_fidelity(self, lo: int, x: torch.Tensor) -> None:
        """Per row: the non-zero features, ``||x - x_hat||^2`` and ``||x||^2`` with ``x``
        the row as float32 and ``x_hat = decode(encode(x))``; and the rows' sum of ``x``."""
        acts, x_hat = self.sae.reconstruct(x)
        xf = x.float()
        err = xf - x_hat.float()
        l0 = (acts != 0).sum(dim=-1)
        sq_err = (err * err).sum(dim=-1)
        sq_norm = (xf * xf).sum(dim=-1)
        self.fidelity_pending.append((lo, l0, sq_err, sq_norm, xf.sum(dim=0)))

    def rewind(self, position: int) -> None:
        """Forget every row at ``position`` or later (speculative decoding: the rows of
        drafts the main model rejected); a later forward observes those positions again."""
        self.buffer = [(lo, x[: position - lo]) for lo, x in self.buffer if lo < position]
        kept = []
        for lo, top_v, top_i, sel in self.pending:
            if lo >= position:
                continue
            n = position - lo
            kept.append((lo, *(t[:n] if t is not None else None for t in (top_v, top_i, sel))))
        self.pending = kept
        self.observed_to = min(self.observed_to, position)

    def flush(self) -> None:
        """Encode the buffered rows in one batch."""
        if self.last_only and self.buffer:
            lo, x = self.buffer[-1]
            self.buffer = [(lo + x.shape[0] - 1, x[-1:])] if x.shape[0] else []
        if not self.buffer:
            return
        starts = [lo for lo, _ in self.buffer]
        xs = [x for _, x in self.buffer]
        self.buffer = []
        contiguous = all(starts[i] + xs[i].shape[0] == starts[i + 1] for i in range(len(starts) - 1))
        pieces = [(starts[0], torch.cat(xs, dim=0))] if contiguous else list(zip(starts, xs))
        for lo, x in pieces:
            # bounded chunks: a long prompt times d_sae activations must not spike memory
            for off in range(0, x.shape[0], FLUSH_CHUNK_ROWS):
                self._encode(lo + off, x[off : off + FLUSH_CHUNK_ROWS])

    def collect(self) -> list[ActivationRecord]:
        """Move pending results to host as records."""
        out: list[ActivationRecord] = []
        e = self.entry
        for lo, n, counts, cols, values in self.packed_pending:
            row_ptr = np.zeros(n + 1, dtype="<i4")
            np.cumsum(counts.cpu().numpy(), out=row_ptr[1:])
            packed = PackedRows(
                rows=n,
                row_ptr=row_ptr.tobytes(),
                indices=cols.to(torch.int32).cpu().numpy().astype("<i4", copy=False).tobytes(),
                values=values.cpu().numpy().astype("<f4", copy=False).tobytes(),
            )
            out.append(
                ActivationRecord(
                    sae_id=e.sae_id, layer=e.layer, read_point=e.read_point, position=lo, packed=packed, tag=e.tag
                )
            )
        self.packed_pending.clear()
        for lo, l0, sq_err, sq_norm, x_sum in self.fidelity_pending:
            stats = FidelityStats(
                rows=int(l0.shape[0]),
                l0=l0.to(torch.int32).cpu().numpy().astype("<i4", copy=False).tobytes(),
                sq_err=sq_err.cpu().numpy().astype("<f4", copy=False).tobytes(),
                sq_norm=sq_norm.cpu().numpy().astype("<f4", copy=False).tobytes(),
                x_sum=x_sum.cpu().numpy().astype("<f4", copy=False).tobytes(),
            )
            out.append(
                ActivationRecord(
                    sae_id=e.sae_id, layer=e.layer, read_point=e.read_point, position=lo, fidelity=stats, tag=e.tag
                )
            )
        self.fidelity_pending.clear()
        for lo, top_v, top_i, sel in self.pending:
            tv = top_v.tolist() if top_v is not None else None
            ti = top_i.tolist() if top_i is not None else None
            sv = sel.tolist() if sel is not None else None
            n = len(tv) if tv is not None else len(sv)  # type: ignore[arg-type]
            for r in range(n):
                pos = lo + r
                top = []
                if tv is not None:
                    top = [FeatureActivation(int(i), float(v)) for v, i in zip(tv[r], ti[r]) if v > 0.0]
                feats = []
                if sv is not None:
                    feats = [FeatureActivation(int(i), float(v)) for i, v in zip(e.features, sv[r])]
                tok = pos - (self.prompt_len - 1)
                out.append(
                    ActivationRecord(
                        sae_id=e.sae_id,
                        layer=e.layer,
                        read_point=e.read_point,
                        position=pos,
                        token_index=tok if tok >= 0 else None,
                        top_k=top,
                        features=feats,
                        tag=e.tag,
                    )
                )
        self.pending.clear()
        return out


__all__ = ["FLUSH_CHUNK_ROWS", "SHORT_FORWARD_ROWS", "MonitorPlan"]
