"""Forward passes for continuous batching: a request's prefill, then shared decode steps.

The scheduler (``gpu_engine.runtime.scheduler``) decides who runs; this class only runs forward
passes and samples each row with its own request's sampler (STYLE §10):

- ``start(seqs)``: the newly admitted requests' prefill — one alone and unpadded (the
  very forward the serial path runs), several of similar length in one left-padded
  forward — with their own hooks; samples their first tokens, then copies each one's KV
  into the batch cache as a new row unless it already finished.
- ``step()``: one decode forward for every running row, with per-row positions, a
  padding mask, and a ``BatchContext`` whose per-attachment delta tables hold each
  request's steering delta in the request's slot; samples every row; one host sync.
- ``remove(seq)``: drops a finished or cancelled row.

Slots, delta and control tables, each forward's ``BatchContext`` and the steering counts
after it are the row router's (``gpu_engine.interp.rows``): the hook reports which
attachments' tables it really added (``BatchContext.applied``); each request steered at
such an attachment gets +1 for that forward pass, so a hook a compiler skipped shows up as
a count below ``forward_passes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...decode.sampling import choose_rows
from ...decode.sequence import Sequence
from ...interp.hooks import BatchContext, HookManager, Segment
from ...interp.rows import RowRouter
from .attention import use_grouped_sdpa
from . import prefix
from .kv_cache import BatchKVCache

if TYPE_CHECKING:  # the runner builds this module's objects: a type, not an import
    from .runner import TransformersRunner

# a padded prefill group may waste at most this share of its (rows × longest prompt) area
MAX_PREFILL_PADDING = 0.25


# the most logits (rows x kept positions x vocabulary) one prefill of requests that read
# their prompt rows' logits may hold: 2**25 floats, 128 MiB
MAX_ECHO_ELEMENTS = 1 << 25


def prefill_groups(seqs: list[Sequence], vocab: int = 1) -> list[list[Sequence]]:
    """Split newly admitted requests into prefill forwards.

    Shortest first, a group grows while its left padding stays under
    ``MAX_PREFILL_PADDING`` of the padded area.  Requests asking for prompt logprobs or
    distributions (they need the logits of their prompt's last rows, ``echo_rows``) are
    grouped among themselves the same way, while the group's logits — rows times the
    most rows any of them keeps, times ``vocab`` — stay within ``MAX_ECHO_ELEMENTS``
    (left padding ends every prompt at the same column, so the last rows line up).  On
    CPU one padded forward of 16 ~20-token prompts took 0.31 s against 0.96 s for 16
    separate ones (SmolLM2, fp32).
    """
    groups: list[list[Sequence]] = []
    for echo in (False, True):
        current: list[Sequence] = []
        for s in sorted((s for s in seqs if (s.echo_from is not None) == echo), key=lambda s: s.n_prompt):
            width = s.n_prompt  # sorted: the newcomer is the longest
            total = sum(x.n_prompt for x in current) + s.n_prompt
            rows = len(current) + 1
            padded = current and (width * rows - total) > MAX_PREFILL_PADDING * width * rows
            too_many = echo and current and rows * max(x.echo_rows for x in [*current, s]) * vocab > MAX_ECHO_ELEMENTS
            if padded or too_many:
                groups.append(current)
                current = []
            current.append(s)
        if current:
            groups.append(current)
    return groups


def _kv(past: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in past.layers]


class BatchedRunner:
    def __init__(self, runner: TransformersRunner, hooks: HookManager, *, max_rows: int) -> None:
        self.runner = runner
        self.hooks = hooks
        self.max_rows = max_rows
        self.device = runner.device
        self.grouped_attention = use_grouped_sdpa(runner.model)
        self.cache = self._new_cache()
        self.rows: list[Sequence] = []
        self.router = RowRouter(device=self.device, max_rows=max_rows)
        self._row_slots: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None  # capture: every row of a decode step, by slot
        self._qk_stage: tuple[torch.Tensor, torch.Tensor] | None = None  # the same for Q/K
        self.steps = 0
        self.lean_steps = 0  # of which without model.forward (lean.py)

    def _new_cache(self) -> BatchKVCache:
        # KV_CACHE_MODE=static or a compiled step: the fixed-shape slab (kv_cache.py)
        fixed = self.max_rows if self.runner.static_kv else 0
        return BatchKVCache(self.runner.num_layers, device=self.device, dtype=self.runner.dtype, fixed_rows=fixed)

    # ------------------------------------------------------------------ rows

    def start(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill newly admitted requests and take their first tokens; the ones not yet
        finished join the batch.  Returns the ones that finished already."""
        finished: list[Sequence] = []
        plain: list[Sequence] = []
        for seq in seqs:
            # the prefix cache (prefix.py): a hit prefills alone, on top of the stored KV
            hit = prefix.look_up(self.runner.prefix_cache, getattr(seq, "prefix_plan", None), seq.prompt_ids)
            if hit is not None:
                finished.extend(self._prefill([seq], hit))
            else:
                plain.append(seq)
        for group in prefill_groups(plain, self.runner.vocab_size):
            finished.extend(self._prefill(group))
        return finished

    def _prefill(self, group: list[Sequence], hit: Any = None) -> list[Sequence]:
        for seq in group:
            self._register(seq)
        try:
            if len(group) == 1:
                logits, past, skips = self._prefill_one(group[0], hit)
            else:
                logits, past, skips = self._prefill_padded(group)
        except BaseException:
            for seq in group:
                self._unregister(seq)
            raise
        ids, lsm = choose_rows(group, logits)
        finished = []
        for i, seq in enumerate(group):
            seq.forwards += 1
            if seq.accept(ids[i], lsm[i] if lsm is not None and seq.want_lp else None):
                self._unregister(seq)
                finished.append(seq)
                self._store(
                    seq, seq.n_prompt, lambda i=i: [(k[i, :, skips[i] :], v[i, :, skips[i] :]) for k, v in _kv(past)]
                )
            else:
                self.cache.merge(past, row=i, skip=skips[i])
                self.rows.append(seq)
                self._row_slots = None
        return finished

    def _prefill_one(self, seq: Sequence, hit: Any = None) -> tuple[torch.Tensor, object, list[int]]:
        """Alone and unpadded: the very forward the serial path runs (hooks count it); on a
        prefix-cache ``hit``, only the prompt past the reused positions, at their positions."""
        start = hit.length if hit is not None else 0
        ctx = BatchContext([Segment(seq.hooks, 0, seq.n_prompt - start, start)]) if seq.hooks is not None else None
        echo = seq.echo_rows
        with self.hooks.active(ctx):
            if hit is not None:
                cache_position = torch.arange(start, seq.n_prompt, device=self.device)
                logits, past = self.runner.forward(
                    seq.prompt[:, start:], prefix.start_cache(hit), cache_position=cache_position
                )
            else:
                logits, past = self.runner.prefill_full_cache(seq.prompt, all_logits=echo)
        if echo:
            seq.echo_logprobs(logits)
        return logits[-1:], past, [0]

    def _prefill_padded(self, group: list[Sequence]) -> tuple[torch.Tensor, object, list[int]]:
        """Several prompts in one left-padded forward: one weight read for all of them."""
        width = max(s.n_prompt for s in group)
        skips = [width - s.n_prompt for s in group]
        input_ids = torch.zeros((len(group), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(group), width), dtype=torch.long, device=self.device)
        for i, (s, pad) in enumerate(zip(group, skips)):
            input_ids[i, pad:] = s.prompt[0]
            mask[i, pad:] = 1
        # each row of width tokens from position -pad: its padding rows sit at negative
        # positions (no gate opens, no monitor reads there)
        parts = [(s.row, i * width, (i + 1) * width, -pad) for i, (s, pad) in enumerate(zip(group, skips))]
        ctx = self.router.context(parts)
        keep = max(s.echo_rows for s in group)
        with self.hooks.active(ctx):
            logits, past = self.runner.prefill_rows(input_ids, mask, keep=keep)
        self.router.count([s.row for s in group], ctx.applied)
        if keep:
            # (rows, keep, V): each request reads its own last rows (prefill_groups keeps
            # the requests that read their prompt rows' logits together)
            for i, s in enumerate(group):
                if s.echo_rows:
                    s.echo_logprobs(logits[i, keep - s.echo_rows :])
            logits = logits[:, -1]
        return logits, past, skips

    def _register(self, seq: Sequence) -> None:
        """A slot for ``seq`` and its steering in the router's tables."""
        if len(self.rows) >= self.max_rows:
            raise RuntimeError("the batch is full")  # the scheduler never lets this happen
        seq.row = self.router.add(seq.hooks)  # type: ignore[attr-defined]
        seq.slot = seq.row.slot  # type: ignore[attr-defined]
        self._arm(seq)

    def _unregister(self, seq: Sequence) -> None:
        row = getattr(seq, "row", None)
        if row is not None:
            self.router.remove(row)
        seq.slot = -1
        self._disarm(seq)

    def _arm(self, seq: Sequence) -> None:
        if seq.capture is not None and not seq.capture_armed:
            for layer in seq.capture.layers:
                self.hooks.arm_capture(layer, self.runner.block(layer)[0])
            for layer in seq.capture.qk_layers:
                self.runner.arm_qk(layer)
            seq.capture_armed = True

    def _disarm(self, seq: Sequence) -> None:
        if seq.capture_armed:
            for layer in seq.capture.layers:  # type: ignore[union-attr]
                self.hooks.disarm_capture(layer)
            for layer in seq.capture.qk_layers:  # type: ignore[union-attr]
                self.runner.disarm_qk(layer)
            seq.capture_armed = False

    def _store(self, seq: Sequence, held: int, layer_kv: Any) -> None:
        """Offer a finished request's KV to the prefix cache (prefix.py)."""
        plan = getattr(seq, "prefix_plan", None)
        # the KV held is the prompt's and every generated token's but the last (never fed)
        if plan is not None and held == seq.n_prompt + len(seq.generated) - 1:
            prefix.store(self.runner.prefix_cache, plan, seq.prompt_ids, seq.generated, held, layer_kv)

    def remove(self, seq: Sequence) -> None:
        row = self.rows.index(seq)
        if getattr(seq, "prefix_plan", None) is not None:
            c, lo = self.cache, self.cache.start[row]
            self._store(
                seq,
                c.length - lo,
                lambda: [
                    (layer.k_buf[row, :, lo : c.length], layer.v_buf[row, :, lo : c.length]) for layer in c.layers
                ],
            )
        moved = self.cache.remove(row)
        if moved is not None:
            self.rows[row] = self.rows[moved]
        self.rows.pop()
        self._row_slots = None
        self._unregister(seq)

    def reset(self) -> None:
        """Forget every row (after a failed step); frees the cache."""
        for seq in self.rows:
            seq.slot = -1
            self._disarm(seq)
        self.router.reset()
        self.rows = []
        self._row_slots = None
        self.cache = self._new_cache()

    def kv_usage(self, running: list[Any]) -> dict[str, Any]:
        """``ReportsKV``: the slab's slots the running rows span (rows × the longest row's
        length, padding included: the slab is left-padded) and the slab reserved."""
        cache = self.cache
        reserved = cache.nbytes()
        slots = cache.row_capacity * cache.slot_capacity
        in_use = reserved * cache.rows * cache.length // slots if slots and running else 0
        return {"bytes_in_use": int(in_use), "capacity_bytes": int(reserved), "source": "kv slab"}

    def cached_bytes(self) -> int:
        """Bytes this runner keeps between requests: the KV slab (it grows to the largest
        batch and context seen, and is kept for the next one) and the capture stages."""
        stages = [self._stage, *(self._qk_stage or ())]
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in stages if t is not None)

    def release_cached(self) -> int:
        """Drop what ``cached_bytes`` counts while no row runs (the engine's idle release,
        TRANSFORMERS_IDLE_CACHE_RELEASE_S); returns the bytes dropped, 0 while rows run."""
        if self.rows:
            return 0
        freed = self.cached_bytes()
        self.cache = self._new_cache()
        self._stage = None
        self._qk_stage = None
        self._row_slots = None
        return freed

    # ------------------------------------------------------------------ step

    def _capture_stage(self) -> torch.Tensor:
        if self._stage is None:
            r = self.runner
            self._stage = torch.zeros((r.num_layers, self.max_rows, r.hidden_size), dtype=r.dtype, device=self.device)
        return self._stage

    def _capture_qk_stage(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._qk_stage is None:
            r = self.runner
            g = r.attention_geometry
            shape = (r.num_layers, self.max_rows)
            self._qk_stage = (
                torch.zeros((*shape, g.num_heads, g.head_dim), dtype=r.dtype, device=self.device),
                torch.zeros((*shape, g.num_kv_heads, g.head_dim), dtype=r.dtype, device=self.device),
            )
        return self._qk_stage

    def step(self) -> list[Sequence]:
        """One decode forward for every row; returns the sequences that finished."""
        rows = self.rows
        cache = self.cache
        cache.reserve(1)
        # the step without model.forward (lean.py) where the model has one and every hook
        # in it now is one the step runs (checked each step: captures arm as rows join)
        lean = None if cache.fixed_rows else self.runner.lean_step()
        if not cache.fixed_rows:
            position_ids, mask = cache.step_inputs()
        # the row fed now is the last generated token, at position n_prompt + n - 1
        parts = [
            (s.row, r, r + 1, s.n_prompt + len(s.generated) - 1)  # type: ignore[attr-defined]
            for r, s in enumerate(rows)
        ]
        if self._row_slots is None:  # kept while the batch is unchanged
            self._row_slots = self.router.row_slots(parts)
        capturing = [s for s in rows if s.capture is not None]
        hidden = any(s.capture.layers for s in capturing)  # type: ignore[union-attr]
        qk = any(s.capture.qk_layers for s in capturing)  # type: ignore[union-attr]
        ctx = self.router.context(
            parts,
            row_slots=self._row_slots,
            capture_stage=self._capture_stage() if hidden else None,
            qk_stage=self._capture_qk_stage() if qk else None,
        )
        tokens = [[s.last_token] for s in rows]
        with self.hooks.active(ctx):
            if cache.fixed_rows:
                bucket, position_ids, mask, slot = cache.fixed_step_inputs()
                tokens += [[0]] * (bucket - len(rows))  # padding rows (kv_cache.py, fixed mode)
                input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
                logits = self.runner.forward_rows_fixed(
                    input_ids, position_ids=position_ids, attention_mask=mask, past=cache, slot=slot, rows=bucket
                )[: len(rows)]
            else:
                input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
                if lean is not None:
                    logits = lean.step_rows(input_ids, cache, position_ids, mask)
                    self.lean_steps += 1
                else:
                    logits = self.runner.forward_rows(
                        input_ids, position_ids=position_ids, attention_mask=mask, past=cache
                    )
        cache.advance(1)
        for s in capturing:  # each capturing request's slot, all its layers at once
            position = s.n_prompt + len(s.generated) - 1
            if ctx.capture_stage is not None:
                s.capture.take(ctx.capture_stage, s.slot, position)  # type: ignore[union-attr]
            if ctx.qk_stage is not None:
                s.capture.take_qk(*ctx.qk_stage, s.slot, position)  # type: ignore[union-attr]
        self.steps += 1
        self.router.count((p[0] for p in parts), ctx.applied)
        ids, lsm = choose_rows(rows, logits)  # the one host sync per step
        finished = []
        for i, s in enumerate(rows):
            s.forwards += 1
            if s.accept(ids[i], lsm[i] if lsm is not None and s.want_lp else None):
                finished.append(s)
        return finished


__all__ = ["BatchedRunner"]
