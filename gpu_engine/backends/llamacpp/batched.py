"""Rows of the engine's continuous batch on one llama.cpp context (``BatchBackend``).

Every running request is a llama.cpp sequence (its own ``seq_id`` in one unified KV
cache); a decode step is one ``llama_decode`` holding one token per row.  Sampling,
text, stops and events are the transformers backend's ``Sequence`` and ``choose_rows``
(torch on the host, each request with its own generator), so a request behaves the same
on both backends.

Steering, per forward:

- every row steered alike (a batch of one, or requests sharing one steering): the
  summed delta per layer becomes llama.cpp's control vector (``llama_set_adapter_cvec``,
  kept while the steering stays the same) — no Python in the forward at all;
- rows steered differently: the control vector is cleared and the eval callback adds
  each row's own delta to the layer's output (``taps.py``), so requests with different
  steering share one multi-sequence decode.  The rows' deltas come from the engine's row
  router (``gpu_engine.interp.rows``): each request's delta sits in its slot of the
  attachment's table, and a forward gathers them by its rows' slots.

A control vector reaches only layer outputs of layers >= 1 (llama.cpp has no tensor at
layer 0, nor at the embeddings, attention or MLP outputs other hook points name:
``taps.py``) and would hide the pre-steering value from a monitor, so steering anywhere
else or next to a pre-steering monitor always goes through the callback.  Monitoring always does, and so does capture
(``taps.py``: a layer's output after its deltas or control vector, and the rotated Q/K).

That is the ``eval_callback_per_row`` mode.  Writing rows in the callback holds only
where the scheduler computes the graph node by node on the CPU backend up to the node
asked for; another ggml backend, or a llama.cpp that fuses the layer's output into the
next op, could compute the next layer from a copy the write never reaches.  So the
backend picks the mode at load (``check_per_row_writes``: a row written in the callback
must reach the logits exactly as llama.cpp's own control vector does, and leave the other
row alone), and otherwise runs ``control_vector_swap``: requests are grouped by their
steering (``steering_signature``), every ``llama_decode`` holds one group only (prefill
and decode steps alike) under that group's control vector, and the groups take turns —
the group waiting longest goes next, so none starves.  Each request keeps its own KV
sequence throughout.  The callback then only reads (monitoring, capture); a
pre-steering monitor at a steered layer reads the layer's output less the control vector
there, and steering at layer 0 is refused by the backend (no control vector reaches it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...decode.sampling import choose_rows
from ...api.protocol import AttachmentKey
from ...decode.sequence import Sequence
from ...interp.hooks import BatchContext
from ...interp.rows import RowRouter
from .taps import (
    FFN_NORM,
    KEY,
    LAYER_OUT,
    PRUNED_AT_LAST,
    QUERY,
    CaptureReader,
    ForwardPlan,
    LayerPlan,
    MonitorSegment,
)

# the capabilities' ``steering_mode``: how requests with different steering share the model
EVAL_CALLBACK_PER_ROW = "eval_callback_per_row"
CONTROL_VECTOR_SWAP = "control_vector_swap"


def capture_readers(seq: Sequence) -> list[tuple[int | None, int, CaptureReader]]:
    """The request's capture as (QUERY, KEY or None for a layer output, layer, reader),
    built once per request (cached on the sequence)."""
    readers = getattr(seq, "_capture_readers", None)
    if readers is None:
        plan = seq.capture
        readers = []
        if plan is not None:
            readers += [(None, layer, CaptureReader(plan.observe, layer)) for layer in plan.layers]
            for layer in plan.qk_layers:
                readers.append((QUERY, layer, CaptureReader(plan.observe_q, layer)))
                readers.append((KEY, layer, CaptureReader(plan.observe_k, layer)))
        seq._capture_readers = readers  # type: ignore[attr-defined]
    return readers


def steering_signature(seq: Sequence) -> tuple:
    """What a request adds where, comparable between requests (cached on the sequence)."""
    sig = getattr(seq, "_steer_sig", None)
    if sig is None:
        items = []
        if seq.hooks is not None:
            for key, plan in sorted(seq.hooks.plans.items()):
                if plan.delta is not None:
                    items.append((key, plan.delta.detach().to(torch.float32).cpu().numpy().tobytes()))
        sig = tuple(items)
        seq._steer_sig = sig  # type: ignore[attr-defined]
    return sig


def by_signature(seqs: list[Sequence]) -> dict[tuple, list[Sequence]]:
    """``seqs`` grouped by steering, groups in the order of their first request."""
    groups: dict[tuple, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(steering_signature(seq), []).append(seq)
    return groups


def check_per_row_writes(backend: Any) -> str | None:
    """The load's self-check of per-row writes in the eval callback: None where they hold,
    else what went wrong.

    Two sequences decode the same token.  A plain decode reads layer L's output (L = 1, or
    0 in a one-layer model) to size a delta as large as the row itself; a second decode
    adds that delta to the first row only, in the callback.  The write must reach the
    logits (the first row's change), stay in its row (the second row's logits as in the
    plain decode) and — where a control vector reaches layer L — equal llama.cpp's own add
    of the same vector at the same node (``llama_set_adapter_cvec``): a graph that fused
    the node, or computed the next layer from a copy, fails one of these."""
    ctx = backend.context
    taps = backend.taps
    n_layer, d = backend.num_layers, backend.hidden_size
    layer = 1 if n_layer > 1 else 0
    seqs = (0, backend.scratch_seq)
    token = min(1, backend.vocab_size - 1)
    tokens = [(token, 0, sid, True) for sid in seqs]
    key = ("per-row write self-check", layer)

    def decode(plan: ForwardPlan | None) -> np.ndarray:
        for sid in seqs:
            ctx.seq_clear(sid)
        taps.run(plan, lambda: ctx.decode(tokens))
        return ctx.logits_rows([0, 1]).astype(np.float64)

    read: list[torch.Tensor] = []
    reader = CaptureReader(lambda _layer, rows, _pos: read.append(rows.clone()), layer)
    try:
        ctx.set_cvec(None, None)
        plain = decode(ForwardPlan({layer: LayerPlan(segments=[MonitorSegment([reader], 0, 2, 0)])}, 2, [0, 1]))
        if not read or read[0].shape != (2, d):
            return f"the eval callback did not hand over the rows of l_out-{layer}"
        norm = float(read[0][0].norm())
        rng = np.random.default_rng(0)
        delta = rng.standard_normal(d).astype(np.float32)
        delta *= max(norm, 1.0) / float(np.linalg.norm(delta))
        # the write goes through ``route`` as every steered row does: the delta in slot 0
        # of a table, the first row in slot 0, the second in the zero slot 1
        table = torch.zeros((2, d), dtype=torch.float32)
        table[0] = torch.from_numpy(delta)
        rows = BatchContext([], row_slots=torch.tensor([0, 1]), delta_tables={key: table})
        plan = ForwardPlan({layer: LayerPlan(keys=[key])}, 2, [0, 1], ctx=rows)
        written = decode(plan)
        if key not in plan.applied:
            return f"the eval callback never reached l_out-{layer}"
        scale = max(float(np.abs(plain).max()), 1e-6)
        tol = 1e-4 * scale
        if np.abs(written[1] - plain[1]).max() > tol:
            return "a row written in the callback changed another sequence's logits"
        if np.abs(written[0] - plain[0]).max() <= 1e-3 * scale:
            return f"a row written in l_out-{layer} did not reach the next layer"
        if layer >= 1:
            data = np.zeros((n_layer - 1, d), dtype=np.float32)
            data[layer - 1] = delta
            ctx.set_cvec(key, data)
            cvec = decode(None)
            if np.abs(written[0] - cvec[0]).max() > tol:
                return (
                    f"a row written in l_out-{layer} gave other logits than llama.cpp's "
                    "control vector adding the same vector there"
                )
    except Exception as exc:  # noqa: BLE001 - any failure means: do not write rows
        return f"{type(exc).__name__}: {exc}"
    finally:
        ctx.set_cvec(None, None)
        for sid in seqs:
            ctx.seq_clear(sid)
    return None


class LlamaBatchRunner:
    def __init__(self, backend: Any, *, max_rows: int, seq_ids: list[int] | None = None) -> None:
        self.backend = backend
        self.max_rows = max_rows
        self.rows: list[Sequence] = []
        self.steps = 0
        self._all_ids = list(seq_ids if seq_ids is not None else range(max_rows))
        self._free_ids = list(reversed(self._all_ids))
        # slots and per-attachment delta tables of the running requests (float32, host)
        self.router = RowRouter(device="cpu", max_rows=len(self._all_ids))
        # control_vector_swap: one steering group per decode
        self.swap = backend.steering_mode == CONTROL_VECTOR_SWAP
        # per steering group, the step it last ran at (the longest waiting runs next)
        self._served: dict[tuple, int] = {}

    @property
    def ctx(self):  # type: ignore[no-untyped-def]
        return self.backend.context

    # ------------------------------------------------------------------ plans

    def _forward(self, parts: list[tuple[Sequence, int, int, int]], tokens: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``tokens``; ``parts``: (sequence, first batch index,
        end batch index, position of the first) for each request in it."""
        backend = self.backend
        n_layer = backend.num_layers
        layers: dict[int, LayerPlan] = {}
        sigs = [steering_signature(s) for s, *_ in parts]
        uniform = all(sig == sigs[0] for sig in sigs)
        # feature controls read each row's own activations: never a control vector
        controlled = any(seq.row.controls for seq, *_ in parts)  # type: ignore[attr-defined]
        qk: dict[tuple[int, int], list[MonitorSegment]] = {}
        # capture: staged by the C filter where the decode's stage fits, else read in Python
        capturing = [(seq, a, b, pos) for seq, a, b, pos in parts if seq.capture is not None]
        stage: set[int] = set()
        stage_qk: set[int] = set()
        for seq, *_ in capturing:
            stage.update(seq.capture.layers)  # type: ignore[union-attr]
            stage_qk.update(seq.capture.qk_layers)  # type: ignore[union-attr]
        staged = bool(capturing) and backend.taps.stage_fits(len(tokens), bool(stage), bool(stage_qk))
        if not staged:
            stage, stage_qk = set(), set()
        monitored: set[AttachmentKey] = set()
        # the layer outputs read by a pre-steering monitor
        pre_layers: set[int] = set()
        node_of = backend.hook_node
        for seq, a, b, pos in parts:
            if seq.hooks is None:
                continue
            # capture reads the layer's output after every attachment's steering
            for kind, layer, reader in () if staged else capture_readers(seq):
                seg = MonitorSegment([reader], a, b, pos)
                if kind is None:
                    lp = layers.setdefault(layer, LayerPlan())
                    lp.segments.append(seg)
                    lp.captured = True
                else:
                    qk.setdefault((kind, layer), []).append(seg)
            for key, plan in seq.hooks.plans.items():
                if plan.pre or plan.post:
                    monitored.add(key)
                    kind, il = node_of(key)
                    if plan.pre and kind == LAYER_OUT:
                        pre_layers.add(il)
        # a control vector adds to layer outputs (``l_out``) of layers >= 1 only
        steered_nodes = {node_of(key) for key, _ in sigs[0]} if uniform else set()
        steered_layers = {il for kind, il in steered_nodes if kind == LAYER_OUT}
        if self.swap and not uniform:
            raise RuntimeError("control_vector_swap: a decode holds one steering only")
        if self.swap and controlled:
            # refused at admission (``LlamaCppBackend._check_steering``): never run unsteered
            raise RuntimeError("control_vector_swap: feature controls cannot run under a control vector")
        # the swap mode steers with control vectors only (layer 0 is refused at admission);
        # a pre-steering monitor then reads the output less the control vector
        use_cvec = (
            uniform
            and bool(sigs[0])
            and not controlled
            and all(kind == LAYER_OUT and il >= 1 and (self.swap or il not in pre_layers) for kind, il in steered_nodes)
        )
        nodes: dict[tuple[int, int], LayerPlan] = {}
        ctx = None
        if monitored or (not use_cvec and (any(sigs) or controlled)):
            rows = [(seq.row, a, b, pos) for seq, a, b, pos in parts]  # type: ignore[attr-defined]
            ctx = self.router.context(rows, only_present=True)
            # the attachments ``route`` runs at each claimed layer: every one a monitor reads;
            # per row, every one that steers; under a control vector, the steered ones at a
            # monitored layer (their deltas added back to the rows less the vector)
            keys = set(monitored)
            steering = {*ctx.delta_tables, *ctx.control_tables}
            if use_cvec:
                steering = {k for k in steering if node_of(k) in {node_of(m) for m in monitored}}
            keys |= steering
            order = {k: i for i, k in enumerate(backend.attachment_stats)}
            for key in sorted(keys, key=lambda k: (order.get(k, len(order)), k)):
                kind, il = node_of(key)
                if kind == LAYER_OUT:
                    layers.setdefault(il, LayerPlan()).keys.append(key)
                    continue
                lp = nodes.setdefault((kind, il), LayerPlan())
                lp.keys.append(key)
                if backend.reads_mlp_input(key):
                    # a transcoder: reads block il's MLP input, writes its MLP output
                    lp.read_input.add(key)
                    nodes.setdefault((FFN_NORM, il), LayerPlan()).stash = True
        applied: set = set()
        if use_cvec:
            seq0 = parts[0][0]
            data = np.zeros((n_layer - 1, backend.hidden_size), dtype=np.float32)
            for key, plan in seq0.hooks.plans.items():  # type: ignore[union-attr]
                if plan.delta is not None:
                    data[node_of(key)[1] - 1] += plan.delta.detach().to(torch.float32).cpu().numpy()
                    applied.add(key)
            for il in steered_layers & {il for il, lp in layers.items() if lp.keys}:
                layers[il].preset = torch.from_numpy(data[il - 1].copy())
            self.ctx.set_cvec(sigs[0], data)
            backend.steering_forwards["control_vector_swap" if self.swap else "control_vector"] += 1
        else:
            self.ctx.set_cvec(None, None)
            if ctx is not None and (ctx.delta_tables or ctx.control_tables):
                backend.steering_forwards["eval_callback"] += 1
        outputs = [i for i, t in enumerate(tokens) if t[3]]
        fplan = (
            ForwardPlan(layers, len(tokens), outputs, ctx=ctx, qk=qk, stage=stage, stage_qk=stage_qk, nodes=nodes)
            if layers or qk or staged or nodes
            else None
        )
        # a KV with no free cell for ``tokens`` drops prefix cache entries first (prefix.py)
        backend.taps.run(fplan, lambda: backend.prefix.decode(tokens))
        if fplan is not None:
            applied |= fplan.applied
        if staged:
            got = fplan.staged  # type: ignore[union-attr]
            for seq, a, b, pos in capturing:
                seq.capture.take_span(  # type: ignore[union-attr]
                    a, b, pos, hidden=got.hidden, q=got.q, k=got.k
                )
        if applied:
            # once per decode, whatever the ubatches: as the transformers hooks count
            for key in applied:
                stats = backend.attachment_stats.get(key)
                if stats is not None:
                    stats.steering_apply_count += 1
            self.router.count((seq.row for seq, *_ in parts), applied)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ rows

    def start(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill newly admitted requests (several per decode, up to n_batch tokens; in the
        swap mode only requests steered alike share a decode) and take their first tokens;
        returns the ones that finished already."""
        logits: dict[int, torch.Tensor] = {}
        echo: dict[int, list[np.ndarray]] = {}
        for seq in seqs:
            if not self._free_ids:
                raise RuntimeError("the batch is full")  # the scheduler never lets this happen
            seq.seq_id = self._free_ids.pop()  # type: ignore[attr-defined]
            seq.row = self.router.add(seq.hooks)  # type: ignore[attr-defined]
            self.ctx.seq_clear(seq.seq_id)  # type: ignore[attr-defined]
        try:
            for seq in seqs:
                # the prefix cache's cells for the prompt's longest stored prefix (prefix.py)
                seq.kv_reused = self.backend.prefix.reuse(seq)  # type: ignore[attr-defined]
            for group in by_signature(seqs).values() if self.swap else [seqs]:
                self._prefill(group, logits, echo)
        except BaseException:
            for seq in seqs:
                self._release(seq)
            raise
        for seq in seqs:
            seq.kv_ready = True  # type: ignore[attr-defined]  # its KV: the prompt, then each fed token
        for seq in seqs:
            if seq.echo_from is not None:
                seq.echo_logprobs(torch.from_numpy(np.concatenate(echo[id(seq)], axis=0)))
        stacked = torch.stack([logits[id(s)] for s in seqs])
        finished = []
        for seq, done in zip(seqs, self._sample(seqs, stacked)):
            if done:
                self._release(seq)
                finished.append(seq)
            else:
                self.rows.append(seq)
        return finished

    def _prefill(
        self, seqs: list[Sequence], logits: dict[int, torch.Tensor], echo: dict[int, list[np.ndarray]]
    ) -> None:
        """The prompts of ``seqs`` through the model, packed into decodes of up to n_batch
        tokens: each one's last-position logits into ``logits`` (by ``id``), its prompt
        logits it reads into ``echo`` (``Sequence.echo_from`` on).  A prompt the prefix cache
        gave a prefix of (``kv_reused`` tokens) prefills from there, at its own positions."""
        n_batch = self.ctx.settings.n_batch
        last_layer = self.backend.num_layers - 1
        # (sequence, offset into its prompt) still to prefill, in order
        queue = [(s, getattr(s, "kv_reused", 0)) for s in seqs]
        while queue:
            tokens: list[tuple[int, int, int, bool]] = []
            parts: list[tuple[Sequence, int, int, int]] = []
            ends: list[tuple[Sequence, int, bool]] = []
            while queue and len(tokens) < n_batch:
                seq, off = queue.pop(0)
                take = min(seq.n_prompt - off, n_batch - len(tokens))
                all_out = self._reads_pruned(seq, last_layer) or self._captures_prompt_rows(seq, last_layer)
                # the rows whose logits the request reads (prompt logprobs, distributions)
                echo_from = seq.echo_from
                first_out = seq.n_prompt - 1 if echo_from is None else echo_from
                a = len(tokens)
                for p in range(off, off + take):
                    out = all_out or p >= first_out
                    tokens.append((seq.prompt_ids[p], p, seq.seq_id, bool(out)))  # type: ignore[attr-defined]
                parts.append((seq, a, a + take, off))
                ends.append((seq, a, off + take == seq.n_prompt))
                if off + take < seq.n_prompt:
                    queue.insert(0, (seq, off + take))
            self._forward(parts, tokens)
            for seq, a, b, off in parts:
                seq.forwards += 1
                echo_from = seq.echo_from
                if echo_from is not None and off + (b - a) > echo_from:
                    # this chunk's rows from echo_from on (each of them produced logits)
                    lo = a + max(echo_from - off, 0)
                    echo.setdefault(id(seq), []).append(self.ctx.logits_rows(list(range(lo, b))))
            for seq, _a, done in ends:
                if done:
                    b = next(p[2] for p in parts if p[0] is seq)
                    logits[id(seq)] = torch.from_numpy(self.ctx.logits(b - 1))

    def _reads_pruned(self, seq: Sequence, layer: int) -> bool:
        """The request monitors a node of ``layer`` (the last) that holds only the rows
        producing logits (its output, MLP input or MLP output: llama.cpp keeps only those
        rows after the last block's attention), or gates a control there by a feature:
        every prompt row must then produce logits, or the records and fired positions would
        miss rows."""
        if seq.hooks is None:
            return False
        for key, p in seq.hooks.plans.items():
            kind, il = self.backend.hook_node(key)
            if il == layer and kind in PRUNED_AT_LAST and (p.pre or p.post or p.conditional):
                return True
        return False

    @staticmethod
    def _captures_prompt_rows(seq: Sequence, layer: int) -> bool:
        """The request captures prompt rows of the last layer, whose output llama.cpp
        keeps only for rows that produce logits: every prompt row must then produce one."""
        plan = seq.capture
        return plan is not None and layer in plan.layers and plan.spec.positions in ("all", "prompt")

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[bool]:
        ids, lsm = choose_rows(seqs, logits)
        return [s.accept(ids[i], lsm[i] if lsm is not None and s.want_lp else None) for i, s in enumerate(seqs)]

    def _turn(self) -> list[Sequence]:
        """The rows the next decode step runs: every row, or in the swap mode the steering
        group that has waited longest (ties: the group of the earliest row).  A group
        counts as served when it joins (its prefill just ran), so groups already waiting
        go before it and every group runs at least once in as many steps as there are
        groups."""
        if not self.swap:
            return self.rows
        groups = by_signature(self.rows)
        served = {sig: self._served.get(sig, self.steps) for sig in groups}
        sig = min(served, key=served.__getitem__)
        served[sig] = self.steps + 1
        self._served = served
        return groups[sig]

    def kv_usage(self, running: list[Any]) -> dict[str, Any]:
        """``ReportsKV``: the positions the running rows hold in the context's KV cache
        × bytes per position (its KV type), and the context's window × the same."""
        per_token = self.backend._kv_bytes_per_token()
        ctx = self.backend.context
        n_ctx = ctx.settings.n_ctx if ctx is not None else None
        held = sum(s.n_prompt + len(s.generated) for s in running)
        return {
            "bytes_in_use": int(held * per_token),
            "capacity_bytes": None if n_ctx is None else int(n_ctx * per_token),
            "source": "llama.cpp context positions",
        }

    def step(self) -> list[Sequence]:
        """One decode forward for every row (in the swap mode, for one steering group's
        rows); returns the sequences that finished."""
        rows = self._turn()
        tokens = []
        parts = []
        for i, s in enumerate(rows):
            pos = s.n_prompt + len(s.generated) - 1
            tokens.append((s.last_token, pos, s.seq_id, True))  # type: ignore[attr-defined]
            parts.append((s, i, i + 1, pos))
        try:
            self._forward(parts, tokens)
        except BaseException:
            for s in rows:
                s.kv_ready = False  # type: ignore[attr-defined]  # not offered to the prefix cache
            raise
        self.steps += 1
        logits = torch.from_numpy(self.ctx.logits_rows(list(range(len(rows)))))
        finished = []
        for s, done in zip(rows, self._sample(rows, logits)):
            s.forwards += 1
            if done:
                finished.append(s)
        return finished

    def _release(self, seq: Sequence) -> None:
        sid = getattr(seq, "seq_id", -1)
        if sid >= 0:
            self.backend.prefix.keep(seq)  # its KV stored for later prompts (prefix.py)
            self.ctx.seq_clear(sid)
            self._free_ids.append(sid)
            seq.seq_id = -1  # type: ignore[attr-defined]
        row = getattr(seq, "row", None)
        if row is not None:
            self.router.remove(row)

    def remove(self, seq: Sequence) -> None:
        self.rows.remove(seq)
        self._release(seq)

    def reset(self) -> None:
        for sid in self._all_ids:
            self.ctx.seq_clear(sid)
        for seq in self.rows:
            seq.seq_id = -1  # type: ignore[attr-defined]
        self.router.reset()
        self.rows = []
        self._free_ids = list(reversed(self._all_ids))
        self._served = {}


def run_serial(runner: LlamaBatchRunner, seq: Sequence, should_stop: Callable[[], bool]) -> None:
    """One request to its end on ``runner`` (the serial path)."""
    try:
        if should_stop():
            seq.cancel()
            return
        if runner.start([seq]):
            return
        while True:
            if should_stop():
                seq.cancel()
                break
            if runner.step():
                break
    finally:
        if seq in runner.rows:
            runner.remove(seq)


__all__ = [
    "CONTROL_VECTOR_SWAP",
    "EVAL_CALLBACK_PER_ROW",
    "LlamaBatchRunner",
    "by_signature",
    "check_per_row_writes",
    "run_serial",
    "steering_signature",
]
