"""Feature controls as tensors: clamp, scale, ablate and gated adds, per row.

A request's ``FeatureControl``s at one attachment become a ``ControlTable`` of J
operations.  For the residual rows ``x`` (n, d) arriving at the hook, with their sequence
positions and (in a batch) the slot of the request each row belongs to, operation j
contributes to row r::

    gate[r, j] · (alpha[j] + beta[j] · a_j(x_r) + gamma[j] · (clip(c, lo_j, hi_j) − c)) · dirs[j]
    with c = x_r · dirs[j]

where ``a_j`` is the activation of feature ``feat[j]`` (encoded from the SAE's selected
columns only, never the whole dictionary), and ``dirs[j]`` is ``W_dec[feat[j]]`` (the unit
direction ``d̂`` for an operation that projects: ``ablate`` and a vector's clamp); ``lo`` /
``hi`` are ``clip_lo`` / ``clip_hi`` (±inf where unbounded):

============  =====  ======  ========  ==========  ===================================
mode          alpha  beta    gamma     clip        contribution
============  =====  ======  ========  ==========  ===================================
add           v      0       0         —           v · d
clamp         v      −1      0         —           (v − a) · d
scale         0      v − 1   0         —           (v − 1) · a · d
ablate        0      0       1         [0, 0]      −(x · d̂) · d̂
vector add    1      0       0         —           strength · v (the row already scaled)
vector clamp  0      0       strength  [min, max]  strength · (clip(c) − c) · d̂
============  =====  ======  ========  ==========  ===================================

``gate[r, j]`` is 1 where row r belongs to operation j's request, its position lies in the
operation's ``[lo, hi)`` (phase and window combined) and, for a conditional operation,
the trigger feature's activation at the row is above the threshold.  Every operation
reads the same ``x``: the residual before this attachment's steering — except a vector's
clamp, which runs after the others, in order, each reading ``x`` plus everything added
before it (the plan builder puts an attachment's plain adds into its table as one add
when it has a clamp, so a clamp reads the row as steered).

In a batch the runner concatenates the tables of every request steering at the attachment
(``ControlTable.concat``); the hook computes all J operations for all n rows with two
small matmuls and masks by slot, so one forward serves every request's own controls.

A splice (``SteeringEntry.splice``, alone in its entry) is a table of no operation that
names its request's slot: every row of that slot (at a position ≥ 0) is replaced by its
target (``splice_rows``) — the SAE's reconstruction ``decode(encode(x))``
(``reconstruction``) or zeros (``zero``), with ``x`` the row read and the target written
where the steering goes (a transcoder: its output replaced by the reconstruction of its
input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..api.protocol import FeatureControl
from ..api.steering import SPLICE_MODES, SteeringVector
from ..sae.module import SAE, SelectedEncoder

# "no upper end" for a position range
FAR = 2**62


def control_range(control: FeatureControl | SteeringVector, prompt_len: int) -> tuple[int, int]:
    """The row positions ``[start, end)`` a control (or a phased vector) may steer: its
    phase (``prompt``: rows below ``prompt_len``; ``completion``: the rows of generated
    tokens) and its window."""
    start, end = {"all": (0, FAR), "prompt": (0, prompt_len), "completion": (prompt_len, FAR)}[control.phase]
    if isinstance(control, FeatureControl) and control.window is not None:
        start = max(start, control.window.start)
        end = min(end, control.window.end if control.window.end is not None else FAR)
    return start, end


@dataclass
class ControlTable:
    sae: SAE
    modes: tuple[str, ...]  # per operation, for counts and fired records
    indices: tuple[int, ...]  # per operation: the feature index it steers
    slot: torch.Tensor  # (J,) long
    feat: torch.Tensor  # (J,) long
    dirs: torch.Tensor  # (J, d)
    alpha: torch.Tensor  # (J,)
    beta: torch.Tensor  # (J,)
    gamma: torch.Tensor  # (J,)
    clip_lo: torch.Tensor  # (J,): the projection's lower bound (-inf: none)
    clip_hi: torch.Tensor  # (J,): its upper bound (+inf: none)
    lo: torch.Tensor  # (J,) long
    hi: torch.Tensor  # (J,) long
    cond_feat: torch.Tensor  # (J,) long
    cond_thr: torch.Tensor  # (J,)
    has_cond: torch.Tensor  # (J,) bool
    conditional: tuple[bool, ...]  # per operation, on the host
    ordered: tuple[bool, ...]  # per operation, on the host: a vector's clamp (runs after the rest, in order)
    encodes: bool  # some operation reads a feature's activation
    projects: bool  # some operation reads x · d
    gated_by_feature: bool  # some operation has a condition
    # splices: the slots whose rows are replaced, whether by zeros, and each one's mode (host)
    splice_slot: torch.Tensor  # (S,) long
    splice_zero: torch.Tensor  # (S,) bool
    splice_modes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # the encoder columns the forward reads, gathered once per table (not per step)
        has_encoder = self.sae.has_encoder
        self.encode_feat = SelectedEncoder(self.sae, self.feat) if self.encodes and has_encoder else None
        self.encode_cond = SelectedEncoder(self.sae, self.cond_feat) if self.gated_by_feature and has_encoder else None

    @property
    def size(self) -> int:
        return len(self.modes)

    @classmethod
    def build(
        cls,
        controls: Sequence[FeatureControl],
        sae: SAE,
        *,
        prompt_len: int,
        vectors: Sequence[tuple[SteeringVector, torch.Tensor]] = (),
        splice: str | None = None,
    ) -> ControlTable:
        """One request's controls (slot 0); ``prompt_len`` places its phases. ``vectors``:
        raw vectors run per row (index -1 in records), ``(d,)`` in the SAE dtype: an add
        (gated to a phase) with its direction already scaled by its strength, added once;
        a clamp with its direction as sent (normalised here).  ``splice``: the request's
        rows replaced (``SPLICE_MODES``; it comes with no control or vector)."""
        if splice is not None and splice not in SPLICE_MODES:
            raise ValueError(f"unknown splice {splice!r}")
        dev, dt = sae.W_dec.device, sae.dtype
        feats = [c.index for c in controls]
        idx = torch.tensor(feats, dtype=torch.long, device=dev)
        rows = sae.W_dec.index_select(0, idx)
        if vectors:
            rows = torch.cat([rows, torch.stack([v for _, v in vectors]).to(device=dev, dtype=rows.dtype)])
            idx = torch.cat([idx, torch.zeros(len(vectors), dtype=torch.long, device=dev)])
            feats = [*feats, *(-1 for _ in vectors)]
            controls = [*controls, *(v for v, _ in vectors)]
        inf = float("inf")
        alpha, beta, gamma, clip_lo, clip_hi, lo, hi = [], [], [], [], [], [], []
        for c in controls:
            if isinstance(c, SteeringVector):
                clamp = c.mode == "clamp"
                alpha.append(0.0 if clamp else 1.0)
                beta.append(0.0)
                gamma.append(float(c.strength) if clamp else 0.0)
                clip_lo.append(-inf if not clamp or c.min is None else float(c.min))
                clip_hi.append(inf if not clamp or c.max is None else float(c.max))
                start, end = control_range(c, prompt_len)
                lo.append(start)
                hi.append(end)
                continue
            v = float(c.value)
            a, b, g = {
                "add": (v, 0.0, 0.0),
                "clamp": (v, -1.0, 0.0),
                "scale": (0.0, v - 1.0, 0.0),
                "ablate": (0.0, 0.0, 1.0),  # the projection clipped to [0, 0]
            }[c.mode]
            alpha.append(a)
            beta.append(b)
            gamma.append(g)
            clip_lo.append(0.0 if c.mode == "ablate" else -inf)
            clip_hi.append(0.0 if c.mode == "ablate" else inf)
            start, end = control_range(c, prompt_len)
            lo.append(start)
            hi.append(end)
        modes = tuple(c.mode for c in controls)
        # what projects reads and writes along the unit direction (normed in float32)
        projecting = torch.tensor([g != 0 for g in gamma], dtype=torch.bool, device=dev)
        if bool(projecting.any()):
            wide = rows.float()
            unit = (wide / wide.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).to(rows.dtype)
            rows = torch.where(projecting[:, None], unit, rows)
        conds = [None if isinstance(c, SteeringVector) else c.condition for c in controls]

        def vec(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        return cls(
            sae=sae,
            modes=modes,
            indices=tuple(feats),
            slot=torch.zeros(len(controls), dtype=torch.long, device=dev),
            feat=idx,
            dirs=rows.contiguous(),
            alpha=vec(alpha, dt),
            beta=vec(beta, dt),
            gamma=vec(gamma, dt),
            clip_lo=vec(clip_lo, dt),
            clip_hi=vec(clip_hi, dt),
            lo=vec(lo, torch.long),
            hi=vec(hi, torch.long),
            cond_feat=vec([k.feature if k is not None else 0 for k in conds], torch.long),
            cond_thr=vec([k.threshold if k is not None else 0.0 for k in conds], dt),
            has_cond=vec([k is not None for k in conds], torch.bool),
            conditional=tuple(k is not None for k in conds),
            ordered=tuple(isinstance(c, SteeringVector) and c.projects for c in controls),
            encodes=any(b != 0 for b in beta),
            projects=any(g != 0 for g in gamma),
            gated_by_feature=any(k is not None for k in conds),
            splice_slot=torch.zeros(1 if splice else 0, dtype=torch.long, device=dev),
            splice_zero=torch.tensor([splice == "zero"] if splice else [], dtype=torch.bool, device=dev),
            splice_modes=(splice,) if splice else (),
        )

    @classmethod
    def concat(cls, parts: Sequence[tuple[ControlTable, int]]) -> ControlTable:
        """The tables of several requests (``(table, slot)``) as one batch table; each
        part's operations keep their order, so part i occupies a contiguous column range."""
        tables = [t for t, _ in parts]
        first = tables[0]

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(t, name) for t in tables])

        return cls(
            sae=first.sae,
            modes=sum((t.modes for t in tables), ()),
            indices=sum((t.indices for t in tables), ()),
            slot=torch.cat([torch.full_like(t.slot, s) for t, s in parts]),
            feat=cat("feat"),
            dirs=cat("dirs"),
            alpha=cat("alpha"),
            beta=cat("beta"),
            gamma=cat("gamma"),
            clip_lo=cat("clip_lo"),
            clip_hi=cat("clip_hi"),
            lo=cat("lo"),
            hi=cat("hi"),
            cond_feat=cat("cond_feat"),
            cond_thr=cat("cond_thr"),
            has_cond=cat("has_cond"),
            conditional=sum((t.conditional for t in tables), ()),
            ordered=sum((t.ordered for t in tables), ()),
            encodes=any(t.encodes for t in tables),
            projects=any(t.projects for t in tables),
            gated_by_feature=any(t.gated_by_feature for t in tables),
            splice_slot=torch.cat([torch.full_like(t.splice_slot, s) for t, s in parts]),
            splice_zero=cat("splice_zero"),
            splice_modes=sum((t.splice_modes for t in tables), ()),
        )

    def splice_rows(
        self, x: torch.Tensor, positions: torch.Tensor, row_slots: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(active (n,) bool, target (n, d) in the SAE dtype)``: the rows a splice
        replaces (its slot's, at positions ≥ 0) and what replaces them — the reconstruction
        of ``x`` (the rows read) or zeros.  The caller writes ``target`` in place of the
        steered rows there (never adds a delta: zeros stay exactly zero, also where the
        stream is a block's ``hidden + residual``)."""
        xs = x.to(self.sae.dtype)
        if row_slots is None:  # one request: every row is the splice's
            active = positions >= 0
            zero_rows = None if self.splice_modes[0] == "reconstruction" else active
        else:
            match = row_slots[:, None] == self.splice_slot
            active = match.any(dim=1) & (positions >= 0)
            zero_rows = (match & self.splice_zero).any(dim=1) if "zero" in self.splice_modes else None
        if "reconstruction" in self.splice_modes:
            target = self.sae.reconstruct(xs)[1]
            if zero_rows is not None:
                target = torch.where(zero_rows[:, None], torch.zeros_like(target), target)
        else:
            target = torch.zeros_like(xs)
        return active, target

    def apply(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        row_slots: torch.Tensor | None = None,
        *,
        written: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(delta (n, d) in the SAE dtype, gate (n, J) bool)`` for rows ``x`` (n, d) at
        ``positions`` (n,); ``row_slots`` (n,) in a batch, None for one request.
        ``written``: the rows the delta is added to when they are not ``x`` (a transcoder
        reads its module's input and writes its output); ``ablate`` and a vector's clamp
        project those."""
        xs = x.to(self.sae.dtype)
        gate = (positions[:, None] >= self.lo) & (positions[:, None] < self.hi)
        if row_slots is not None:
            gate &= row_slots[:, None] == self.slot
        if self.gated_by_feature:
            trig = self.encode_cond(xs)  # type: ignore[misc]
            gate &= ~self.has_cond | (trig > self.cond_thr)
        coef = self.alpha.expand(xs.shape[0], -1)
        if self.encodes:
            coef = coef + self.beta * self.encode_feat(xs)  # type: ignore[misc]
        out = xs if written is None else written.to(self.sae.dtype)
        if self.projects:
            proj = out @ self.dirs.T
            clipped = torch.minimum(torch.maximum(proj, self.clip_lo), self.clip_hi)
            # an operation that does not project has gamma 0 and unbounded clips: adds 0
            coef = coef + self.gamma * (clipped - proj)
        if not any(self.ordered):
            return (coef * gate) @ self.dirs, gate
        together = torch.tensor([not o for o in self.ordered], dtype=torch.bool, device=gate.device)
        delta = (coef * (gate & together)) @ self.dirs
        for j, ordered in enumerate(self.ordered):
            if ordered:  # reads the row with everything before it added
                u = self.dirs[j]
                c = (out + delta) @ u
                clipped = torch.minimum(torch.maximum(c, self.clip_lo[j]), self.clip_hi[j])
                step = self.gamma[j] * (clipped - c) * gate[:, j]
                delta = delta + step[:, None] * u
        return delta, gate


__all__ = ["FAR", "ControlTable", "control_range"]
