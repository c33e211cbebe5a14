"""Forward passes for continuous batching: a request's prefill, then shared decode steps.

The scheduler (``gpu_engine.scheduler``) decides who runs; this class only runs forward
passes and samples each row with its own request's sampler (STYLE §10):

- ``start(seq)``: the request's prefill, alone and unpadded (so it is the very forward
  the serial path runs), with its own hooks; samples its first token, then copies its
  KV into the batch cache as a new row unless it already finished.
- ``step()``: one decode forward for every running row, with per-row positions, a
  padding mask, and a ``BatchContext`` whose per-attachment delta tables hold each
  request's steering delta in the request's slot; samples every row; one host sync.
- ``remove(seq)``: drops a finished or cancelled row.

Steering counts: the hook reports which attachments' tables it really added
(``BatchContext.applied``); each request steered at such an attachment gets +1 for that
forward pass, so a hook a compiler skipped shows up as a count below ``forward_passes``.
"""

from __future__ import annotations

import torch

from ...hooks import BatchContext, HookManager, Segment
from ...protocol import AttachmentKey
from .kv_cache import BatchKVCache
from .runner import TransformersRunner
from .sampling import sample_rows
from .sequence import Sequence


class BatchedRunner:
    def __init__(self, runner: TransformersRunner, hooks: HookManager, *, max_rows: int) -> None:
        self.runner = runner
        self.hooks = hooks
        self.max_rows = max_rows
        self.device = runner.device
        self.cache = BatchKVCache(runner.num_layers, device=runner.device, dtype=runner.dtype)
        self.rows: list[Sequence] = []
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self._tables: dict[AttachmentKey, torch.Tensor] = {}
        self._steered: dict[AttachmentKey, list[Sequence]] = {}
        self._row_slots: torch.Tensor | None = None
        self.steps = 0

    # ------------------------------------------------------------------ rows

    def start(self, seq: Sequence) -> bool:
        """Prefill ``seq`` and take its first token; True when that already finished it."""
        runner = self.runner
        ctx = BatchContext([Segment(seq.hooks, 0, seq.n_prompt, 0)]) if seq.hooks is not None else None
        echo = seq.sampling.prompt_logprobs
        with self.hooks.active(ctx):
            logits, past = runner.prefill_full_cache(seq.prompt, all_logits=echo)
        seq.forwards += 1
        if echo:
            seq.echo_logprobs(logits)
        last = logits[-1]
        token = seq.sampler.sample(last)
        seq.sampler.observe(token)
        lsm = torch.log_softmax(last.float(), dim=-1) if seq.want_lp else None
        if seq.accept(int(token), lsm):
            return True
        self._add(seq, past)
        return False

    def _add(self, seq: Sequence, past: object) -> None:
        if len(self.rows) >= self.max_rows:
            raise RuntimeError("the batch is full")  # the scheduler never lets this happen
        self.cache.merge(past)
        seq.slot = self._free_slots.pop()
        self.rows.append(seq)
        self._row_slots = None
        for key, plan in (seq.hooks.plans.items() if seq.hooks is not None else ()):
            if plan.delta is None:
                continue
            table = self._tables.get(key)
            if table is None:
                table = torch.zeros((self.max_rows, plan.delta.shape[-1]), dtype=plan.delta.dtype, device=self.device)
                self._tables[key] = table
                self._steered[key] = []
            table[seq.slot] = plan.delta
            self._steered[key].append(seq)

    def remove(self, seq: Sequence) -> None:
        row = self.rows.index(seq)
        moved = self.cache.remove(row)
        if moved is not None:
            self.rows[row] = self.rows[moved]
        self.rows.pop()
        self._row_slots = None
        for key in [k for k, seqs in self._steered.items() if seq in seqs]:
            seqs = self._steered[key]
            seqs.remove(seq)
            if seqs:
                self._tables[key][seq.slot].zero_()
            else:  # nobody steers here any more: the hook skips the add entirely
                del self._steered[key], self._tables[key]
        self._free_slots.append(seq.slot)
        seq.slot = -1

    def reset(self) -> None:
        """Forget every row (after a failed step); frees the cache."""
        for seq in self.rows:
            self._free_slots.append(seq.slot)
            seq.slot = -1
        self.rows = []
        self._tables.clear()
        self._steered.clear()
        self._row_slots = None
        self.cache = BatchKVCache(self.runner.num_layers, device=self.device, dtype=self.runner.dtype)

    # ------------------------------------------------------------------ step

    def step(self) -> list[Sequence]:
        """One decode forward for every row; returns the sequences that finished."""
        rows = self.rows
        cache = self.cache
        cache.reserve(1)
        position_ids, mask = cache.step_inputs()
        if self._row_slots is None:
            self._row_slots = torch.tensor([s.slot for s in rows], dtype=torch.long, device=self.device)
        segments = []
        for r, s in enumerate(rows):
            if s.monitoring:
                # the row fed now is the last generated token, at position n_prompt + n - 1
                segments.append(Segment(s.hooks, r, r + 1, s.n_prompt + len(s.generated) - 1))  # type: ignore[arg-type]
        ctx = BatchContext(segments, row_slots=self._row_slots, delta_tables=self._tables)
        input_ids = torch.tensor([[s.last_token] for s in rows], dtype=torch.long, device=self.device)
        with self.hooks.active(ctx):
            logits = self.runner.forward_rows(input_ids, position_ids=position_ids, attention_mask=mask, past=cache)
        cache.advance(1)
        self.steps += 1
        for key in ctx.applied:
            for s in self._steered.get(key, ()):
                s.hooks.plans[key].count += 1  # type: ignore[union-attr]
        tokens = sample_rows([s.sampler for s in rows], logits)
        lsm = None
        if any(s.want_lp for s in rows):
            lsm = torch.log_softmax(logits.float(), dim=-1)
        for i, s in enumerate(rows):
            if not s.sampler.plain_greedy:
                s.sampler.observe(tokens[i : i + 1])
        ids = tokens.tolist()  # the one host sync per step
        finished = []
        for i, s in enumerate(rows):
            s.forwards += 1
            if s.accept(ids[i], lsm[i] if lsm is not None and s.want_lp else None):
                finished.append(s)
        return finished


__all__ = ["BatchedRunner"]
