"""Steering, monitoring and capture inside ``llama_decode``, through the context's eval
callback.

llama.cpp names each layer's output ``l_out-{il}`` (the residual stream after block
``il``, after any control vector): the same point the transformers backend hooks.  The
scheduler asks the callback about every graph node (``ask=True``); for a node we claim
it computes the graph up to that node and calls again (``ask=False``) before any later
node runs, so rows written there are what the next layer reads.

An SAE at another hook point claims its own node (``ForwardPlan.nodes``; the backend's
``hook_node`` maps a point to it): ``attn_out-{il}`` (the attention output projection's
result, before the residual add), ``ffn_out-{il}`` (the MLP's down projection, before
the add), ``embd`` (the token embeddings entering block 0: resid_pre of layer 0; resid_pre
of a later layer is the previous ``l_out``); a transcoder reads ``ffn_norm-{il}`` (the
MLP's input, after the norm's gain: its rows are kept when that node runs) and writes
``ffn_out-{il}``.  The residual adds after those nodes read the rows written there.

Before each decode the batch runner publishes a ``ForwardPlan``: the forward's
``BatchContext`` (``gpu_engine.interp.rows.RowRouter.context``: each row's slot and
position, the delta and control tables, the monitored segments) and, per claimed layer,
the attachments there.  The callback hands each attachment's rows to
``gpu_engine.interp.hooks.route`` — the one per-row step the transformers hooks and
vLLM's workers run: pre-steering monitors, each row's delta, every request's feature
controls in one masked pass, the gates of conditional controls, post-steering monitors —
in attach order (the order the transformers hooks run in), and writes the steered rows
back in place, so the next layer reads them.  Where a control vector steers the decode
instead (every row steered alike, and always in the ``control_vector_swap`` mode,
``batched.py``) the node already holds it: at a monitored layer, a layer's ``preset`` is
that vector, and ``route`` reads the rows less it and adds the deltas back itself in a
copy that is written nowhere (monitors read what they would on transformers; the graph
keeps llama.cpp's own add).  With no plan published the callback claims nothing and costs
one Python call per graph node — or none at all with the C filter (``shim.py``), which
answers llama.cpp's per-node questions without entering Python.

Rows: llama.cpp splits a batch into ubatches in order (one KV stream: ``split_simple``),
so the callback keeps a per-layer row offset and hands ``route`` that window of the
context (``BatchContext.window``).  The last layer's output only holds the rows that
produce logits (llama.cpp drops the others before the last block's FFN), so its rows map
to the batch's output tokens instead (``BatchContext.select``); the runner asks for
logits at every prompt row of a request that monitors or gates the last layer.

Capture (``gpu_engine.interp.capture``) reads the same nodes: a request's hidden-state rows
are taken from ``l_out-{il}`` after the steering (so a steered request captures
its steered stream), like a post-steering monitor.  Q/K capture claims two more nodes per
layer: the graph names the query projection, its reshape and the rotary embedding's
output all ``Qcur-{il}`` (``Kcur-{il}`` likewise), so only the one made by
``GGML_OP_ROPE`` is read — (head_dim, heads, tokens) float32, every token of the batch at
every layer (the last layer's pruning comes after attention).  For rope type NORM (the
llama family) the GGUF converter interleaved each head's two rotary halves
(``convert_hf_to_gguf``'s permute, ``offline_assets.tiny_gguf``); the rows are put
back in the checkpoint's order, so a head's vector is the one the transformers backend
captures.

With the C filter, captured nodes are *staged*: the filter copies each one's rows into
a per-kind buffer of (n_layer, rows, row) (``shim.py``), no Python runs for them inside
``llama_decode``, and after it the plan's ``staged`` stages (``Staged``) hand each
request its rows with one copy per kind (``CapturePlan.take_span``).  A decode whose
stage would pass ``STAGE_MAX_BYTES`` (a long prefill of a wide model), or a build without
the C filter, reads captured nodes in Python instead (``CaptureReader`` segments), with
the same rows.  After the decode every captured node must have handed over every row it
owes: a graph that never produced one is an error, not a capture of zeros.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llama_cpp.llama_cpp as lc
import numpy as np
import torch

from ...api.protocol import AttachmentKey
from ...interp.hooks import AttachmentStats, BatchContext, route
from .native import GGML_BASE, GGML_OP_ROPE, GGML_TYPE_F32, NAME_OFFSET, OP_OFFSET, GGMLTensor
from .shim import STAGE, TAP, TAP_FN, Filter, load_filter

# what a claimed node is (the C filter's ``kind``): a layer output, a rotated query or
# key; and, for SAEs at other hook points (tapped, never staged), block il's attention
# output (``attn_out-{il}``: after the output projection, before the residual add), its
# MLP output (``ffn_out-{il}``, before the add), its MLP input (``ffn_norm-{il}``, after
# the norm: what a transcoder reads) and the embeddings (``embd``, il = 0)
LAYER_OUT, QUERY, KEY = 0, 1, 2
ATTN_OUT, FFN_OUT, FFN_NORM, EMBD = 3, 4, 5, 6
SUB_NODES = (ATTN_OUT, FFN_OUT, FFN_NORM, EMBD)
NODE_NAMES = {LAYER_OUT: "l_out", ATTN_OUT: "attn_out", FFN_OUT: "ffn_out", FFN_NORM: "ffn_norm"}
# nodes of the last layer that hold only the rows producing logits (llama.cpp drops the
# others after the last block's attention)
PRUNED_AT_LAST = (LAYER_OUT, FFN_OUT, FFN_NORM)


def node_name(kind: int, il: int) -> str:
    """The graph's name of node ``(kind, il)``."""
    return "embd" if kind == EMBD else f"{NODE_NAMES[kind]}-{il}"


# the most one decode's capture stages may take (every kind, every layer): a decode that
# would need more (a long prefill of a wide model) reads its captured nodes in Python
STAGE_MAX_BYTES = 64 << 20


class CaptureReader:
    """A request's ``CapturePlan`` reading one node's rows, handed them as a monitor is
    (``observe(rows, position)``); ``take`` is the plan's ``observe``, ``observe_q`` or
    ``observe_k``."""

    __slots__ = ("layer", "take")

    def __init__(self, take, layer: int) -> None:  # type: ignore[no-untyped-def]
        self.take = take
        self.layer = layer

    def observe(self, rows: torch.Tensor, position: int) -> None:
        self.take(self.layer, rows, position)


@dataclass
class MonitorSegment:
    """Batch tokens [start, end) of one request, at sequence positions from ``position``:
    its ``monitors`` (a ``CaptureReader``, anything with ``observe(rows, position)``) are
    handed those rows of a node, after its steering.  SAE monitors are not segments here:
    ``route`` runs them from the plan's ``BatchContext``."""

    monitors: list[CaptureReader]
    start: int
    end: int
    position: int


@dataclass
class LayerPlan:
    # the attachments at this layer whose rows go through ``route`` (steering, SAE
    # monitors), in the order the transformers backend's hooks run (attach order)
    keys: list[AttachmentKey] = field(default_factory=list)
    # readers of the layer's rows after every attachment's steering (capture)
    segments: list[MonitorSegment] = field(default_factory=list)
    captured: bool = False  # some segment is a capture: every row must arrive
    # (d,) what llama.cpp's control vector already added to every row of this node:
    # ``route`` reads the rows less it and adds the deltas back in a copy, written nowhere
    preset: torch.Tensor | None = None
    # the attachments among ``keys`` that read the MLP's input (transcoders: the
    # ``ffn_norm`` rows of the same layer, kept when that node ran) and write here
    read_input: set[AttachmentKey] = field(default_factory=set)
    # an ``ffn_norm`` node: keep its rows for the transcoders at ``ffn_out``
    stash: bool = False


# ``route``'s per-call attachment counter: the runner counts each attachment once per
# ``llama_decode`` (from ``BatchContext.applied``), however many ubatches the callback saw
_PER_CALL = AttachmentStats()


@dataclass
class ForwardPlan:
    layers: dict[int, LayerPlan]
    n_tokens: int
    output_rows: list[int]  # batch indices with logits, in order (the last layer's rows)
    # the decode's rows as ``route`` reads them (None: the plan only captures)
    ctx: BatchContext | None = None
    # Q/K capture: per (QUERY or KEY, layer), the segments reading the rotated rows
    qk: dict[tuple[int, int], list[MonitorSegment]] = field(default_factory=dict)
    # staged capture (``EvalTaps.stages``): layers whose output rows, and layers whose
    # rotated Q and K, the C filter copies into the stage; after the decode, ``staged``
    stage: set[int] = field(default_factory=set)
    stage_qk: set[int] = field(default_factory=set)
    staged: Staged | None = None
    # SAEs at other hook points: per (ATTN_OUT, FFN_OUT, FFN_NORM or EMBD, layer), the
    # attachments there (``keys`` and ``read_input`` only)
    nodes: dict[tuple[int, int], LayerPlan] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.layers and not self.qk and not self.stage and not self.stage_qk and not self.nodes

    @property
    def applied(self) -> set[AttachmentKey]:
        """The attachments whose steering the callback added (``BatchContext.applied``)."""
        return self.ctx.applied if self.ctx is not None else set()


@dataclass
class Staged:
    """One decode's staged rows, indexed by layer and batch token (the last layer's
    pruned rows put back at their batch tokens): hidden (n_layer, n_tokens, d), q
    (n_layer, n_tokens, heads, head_dim), k (n_layer, n_tokens, kv_heads, head_dim).
    Views of the stage: read them before the next decode."""

    hidden: torch.Tensor | None
    q: torch.Tensor | None
    k: torch.Tensor | None


def _raise_missing(missing: list[str], n_tokens: int) -> None:
    if missing:
        raise RuntimeError(
            f"llama.cpp's graph did not hand over every row of {', '.join(missing)} "
            f"({n_tokens} tokens): this model's graph cannot be captured there"
        )


class EvalTaps:
    """The eval callback object; one per context (it must outlive the context).

    ``hidden_size`` and ``heads`` ((heads, kv_heads, head_dim)) size the rows staged
    capture copies; without them (or without the C filter) captured nodes are read in
    Python."""

    def __init__(
        self,
        n_layer: int,
        *,
        interleaved_rope: bool = False,
        hidden_size: int | None = None,
        heads: tuple[int, int, int] | None = None,
    ) -> None:
        self.n_layer = n_layer
        self.names = {
            f"{prefix}-{il}".encode(): (kind, il)
            for il in range(n_layer)
            for kind, prefix in (
                (LAYER_OUT, "l_out"),
                (QUERY, "Qcur"),
                (KEY, "Kcur"),
                (ATTN_OUT, "attn_out"),
                (FFN_OUT, "ffn_out"),
                (FFN_NORM, "ffn_norm"),
            )
        }
        # the embeddings (older llama.cpp graphs named them ``inp_embd``)
        self.names[b"embd"] = self.names[b"inp_embd"] = (EMBD, 0)
        # per layer, the ``ffn_norm`` rows of the ubatch running (transcoders read them)
        self._stash: dict[int, torch.Tensor] = {}
        # Q/K rows of a rope-NORM model come in interleaved pairs (see the module doc)
        self.interleaved_rope = interleaved_rope
        self.plan: ForwardPlan | None = None
        self._offsets: dict[tuple[int, int], int] = {}
        self._error: BaseException | None = None
        lib = load_filter()
        self.native_filter = lib is not None
        self.heads = heads
        self.stage_max_bytes = STAGE_MAX_BYTES
        # floats per row: a layer output, a rotated query, a rotated key (0: not staged)
        rows = (
            None
            if hidden_size is None
            else (hidden_size, heads[0] * heads[2] if heads else 0, heads[1] * heads[2] if heads else 0)
        )
        self.rows = rows
        # the stage: per kind a (n_layer, capacity, row) float32 buffer, made on first use
        self._stage: list[np.ndarray | None] = [None, None, None]
        self._capacity = 0
        self._got = np.zeros((3, n_layer), dtype=np.int64)
        if lib is not None:
            # the C filter answers every "ask"; Python runs once per claimed node
            self.filter = Filter()
            self.filter.n_layer = n_layer
            self.filter.name_offset = NAME_OFFSET
            self.filter.op_offset = OP_OFFSET
            self.filter.rope_op = GGML_OP_ROPE if GGML_OP_ROPE is not None else -1
            self._tap_fn = TAP_FN(self._tap)
            self.filter.tap = self._tap_fn
            self._lib = lib
            address = ctypes.cast(lib.millm_eval_filter, ctypes.c_void_p).value
            self.callback = lc.ggml_backend_sched_eval_callback(address)
            self.user_data = ctypes.addressof(self.filter)
            if rows is not None and GGML_BASE is not None:
                self.filter.type_offset = GGMLTensor.type.offset
                self.filter.ne_offset = GGMLTensor.ne.offset
                self.filter.nb_offset = GGMLTensor.nb.offset
                self.filter.tensor_get = ctypes.cast(GGML_BASE.ggml_backend_tensor_get, ctypes.c_void_p).value
                for kind, width in enumerate(rows):
                    self.filter.row_floats[kind] = width
                self.filter.got = self._got.ctypes.data
        else:
            self.callback = lc.ggml_backend_sched_eval_callback(self._cb)
            self.user_data = None

    @property
    def stages(self) -> bool:
        """Captured nodes are copied by the C filter (staged), not read in Python."""
        return self.native_filter and self.rows is not None and GGML_BASE is not None

    def stage_fits(self, n_tokens: int, hidden: bool, qk: bool) -> bool:
        """A decode of ``n_tokens`` can stage its capture within ``STAGE_MAX_BYTES``."""
        if not self.stages:
            return False
        if qk and self.heads is None:
            return False
        rows = self.rows or (0, 0, 0)
        width = (rows[0] if hidden else 0) + (rows[1] + rows[2] if qk else 0)
        return self.n_layer * n_tokens * width * 4 <= self.stage_max_bytes

    def _prepare_stage(self, plan: ForwardPlan) -> None:
        need = {LAYER_OUT} if plan.stage else set()
        if plan.stage_qk:
            need |= {QUERY, KEY}
        rows = self.rows or (0, 0, 0)
        held = need | {kind for kind in range(3) if self._stage[kind] is not None}

        def size(capacity: int, kinds: set[int]) -> int:
            return self.n_layer * capacity * sum(rows[k] for k in kinds) * 4

        if plan.n_tokens > self._capacity or size(self._capacity, held) > self.stage_max_bytes:
            # made again at what this decode needs (it fits STAGE_MAX_BYTES: stage_fits),
            # so the buffers kept between decodes stay within it too
            small = size(16, need) <= self.stage_max_bytes
            self._capacity = max(plan.n_tokens, 16) if small else plan.n_tokens
            self._stage = [None, None, None]
        self.filter.capacity = self._capacity
        for kind in need:
            if self._stage[kind] is None:
                width = self.rows[kind]  # type: ignore[index]
                self._stage[kind] = np.empty((self.n_layer, self._capacity, width), dtype=np.float32)
        for kind in range(3):
            buf = self._stage[kind]
            self.filter.stage[kind] = buf.ctypes.data if buf is not None else None
        self._got[:] = 0
        self.filter.error = 0

    def _take_stage(self, plan: ForwardPlan) -> Staged:
        """The decode's staged rows (see ``Staged``), after checking that every staged node
        handed over every row it owes."""
        n = plan.n_tokens
        missing = [
            f"l_out-{il}" for il in sorted(plan.stage) if self._got[LAYER_OUT, il] not in (n, len(plan.output_rows))
        ]
        missing += [
            f"{name}-{il} (after rope)"
            for il in sorted(plan.stage_qk)
            for kind, name in ((QUERY, "Qcur"), (KEY, "Kcur"))
            if self._got[kind, il] != n
        ]
        _raise_missing(missing, n)
        hidden = q = k = None
        if plan.stage:
            hidden = torch.from_numpy(self._stage[LAYER_OUT])[:, :n]  # type: ignore[arg-type]
            last = self.n_layer - 1
            m = int(self._got[LAYER_OUT, last])
            if last in plan.stage and m != n:  # the last layer's rows are the output rows
                rows = hidden[last, :m].clone()
                hidden[last].index_copy_(0, torch.tensor(plan.output_rows, dtype=torch.long), rows)
        if plan.stage_qk:
            qs, ks = (
                torch.from_numpy(self._stage[kind])[:, :n]  # type: ignore[arg-type]
                for kind in (QUERY, KEY)
            )
            heads, kv_heads, head_dim = self.heads  # type: ignore[misc]
            q = qs.unflatten(-1, (heads, head_dim))
            k = ks.unflatten(-1, (kv_heads, head_dim))
            if self.interleaved_rope:  # pairs (2i, 2i+1) back to the halves (i, i + d/2)
                layers = torch.tensor(sorted(plan.stage_qk), dtype=torch.long)
                for t in (q, k):
                    sel = t.index_select(0, layers)
                    t.index_copy_(0, layers, torch.cat((sel[..., 0::2], sel[..., 1::2]), dim=-1))
        return Staged(hidden, q, k)

    def run(self, plan: ForwardPlan | None, decode) -> None:  # type: ignore[no-untyped-def]
        """``decode()`` with ``plan`` published; re-raises what the callback hit.  A plan
        with staged capture gets its ``staged`` rows."""
        self.plan = plan if plan is not None and not plan.empty else None
        self._offsets = {}
        self._error = None
        staging = self.plan is not None and bool(self.plan.stage or self.plan.stage_qk)
        if staging:
            self._prepare_stage(self.plan)  # type: ignore[arg-type]
        if self.native_filter and self.plan is not None:
            for il in self.plan.layers:
                self.filter.wanted[il] = TAP
            for il in self.plan.stage:
                self.filter.wanted[il] |= STAGE
            for _, il in self.plan.qk:
                self.filter.wanted_qk[il] = TAP
            for il in self.plan.stage_qk:
                self.filter.wanted_qk[il] |= STAGE
            for kind, il in self.plan.nodes:
                self.filter.wanted_sub[kind - ATTN_OUT][il] = TAP
            self.filter.active = 1
        try:
            decode()
        finally:
            published = self.plan
            if self.native_filter and published is not None:
                self.filter.active = 0
                for il in (*published.layers, *published.stage):
                    self.filter.wanted[il] = 0
                for il in (*(il for _, il in published.qk), *published.stage_qk):
                    self.filter.wanted_qk[il] = 0
                for kind, il in published.nodes:
                    self.filter.wanted_sub[kind - ATTN_OUT][il] = 0
            self.plan = None
            self._stash = {}
        if self._error is not None:
            raise self._error
        if staging and self.filter.error:
            kind, il = self.filter.error_kind, self.filter.error_layer
            name = ("l_out", "Qcur", "Kcur")[kind]
            why = (
                "is not a dense float32 block of the model's rows"
                if self.filter.error == 1
                else "has more rows than the decode"
            )
            raise RuntimeError(f"capture: llama.cpp's {name}-{il} {why}")
        if published is not None:
            self._check_captured(published)
            if staging:
                published.staged = self._take_stage(published)

    def _check_captured(self, plan: ForwardPlan) -> None:
        """Every captured node read in Python handed over its rows (a graph without the
        node, or with it renamed, would otherwise leave a capture of uninitialised rows)."""
        missing = []
        for il, lp in plan.layers.items():
            got = self._offsets.get((LAYER_OUT, il), 0)
            if lp.captured and got not in (plan.n_tokens, len(plan.output_rows)):
                missing.append(f"l_out-{il}")
        for kind, il in plan.qk:
            if self._offsets.get((kind, il), 0) != plan.n_tokens:
                missing.append(f"{'Qcur' if kind == QUERY else 'Kcur'}-{il} (after rope)")
        _raise_missing(missing, plan.n_tokens)

    def _tap(self, t: int, kind: int, il: int) -> bool:
        """A claimed node, computed (the C filter's call)."""
        plan = self.plan
        if plan is None:
            return True
        try:
            if kind == LAYER_OUT:
                if il in plan.layers:
                    self._apply(GGMLTensor.from_address(t), il, plan.layers[il], plan)
            elif kind in SUB_NODES:
                if (kind, il) in plan.nodes:
                    self._apply(GGMLTensor.from_address(t), il, plan.nodes[(kind, il)], plan, kind)
            elif (kind, il) in plan.qk:
                self._apply_qk(GGMLTensor.from_address(t), kind, il, plan.qk[(kind, il)])
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
        found = self.names.get(name)
        if found is None:
            return False
        kind, il = found
        if kind == LAYER_OUT:
            if il not in plan.layers:
                return False
        elif kind in SUB_NODES:
            if (kind, il) not in plan.nodes:
                return False
        elif (kind, il) not in plan.qk:
            return False
        elif ctypes.c_int.from_address(t + OP_OFFSET).value != GGML_OP_ROPE:
            return False  # the projection and its reshape carry the same name: only rope's
        if ask:
            return True
        return self._tap(t, kind, il)

    @staticmethod
    def _host_array(tensor: GGMLTensor, shape: tuple[int, ...], what: str) -> tuple[np.ndarray, bool]:
        """The tensor's float32 data as an array of ``shape`` (ggml's dims reversed):
        a view of host memory, or a copy of a device buffer (then False)."""
        buf = tensor.buffer
        host = GGML_BASE is None or not buf or GGML_BASE.ggml_backend_buffer_is_host(buf)
        if host and not tensor.data:
            raise RuntimeError(f"{what} has no data")
        if host:
            arr = np.ctypeslib.as_array(ctypes.cast(tensor.data, ctypes.POINTER(ctypes.c_float)), shape=shape)
        else:  # a device buffer: copied out (and written back by the caller if changed)
            arr = np.empty(shape, dtype=np.float32)
            GGML_BASE.ggml_backend_tensor_get(ctypes.addressof(tensor), arr.ctypes.data, 0, arr.nbytes)
        return arr, host

    def _apply_qk(self, tensor: GGMLTensor, kind: int, il: int, segments: list[MonitorSegment]) -> None:
        what = f"{'Qcur' if kind == QUERY else 'Kcur'}-{il}"
        d, h, n = int(tensor.ne[0]), int(tensor.ne[1]), int(tensor.ne[2])
        if (
            tensor.type != GGML_TYPE_F32
            or int(tensor.ne[3]) != 1
            or (int(tensor.nb[0]), int(tensor.nb[1]), int(tensor.nb[2])) != (4, 4 * d, 4 * d * h)
        ):
            raise RuntimeError(
                f"{what} is not a dense float32 (tokens, heads, head_dim) block "
                f"(type {tensor.type}, ne {list(tensor.ne)}, nb {list(tensor.nb)})"
            )
        arr, _ = self._host_array(tensor, (n, h, d), what)
        rows = torch.from_numpy(arr)
        if self.interleaved_rope:  # pairs (2i, 2i+1) back to the halves (i, i + d/2)
            rows = torch.cat((rows[..., 0::2], rows[..., 1::2]), dim=-1)
        lo = self._offsets.get((kind, il), 0)
        self._offsets[(kind, il)] = lo + n
        for seg in segments:
            a, b = max(seg.start, lo), min(seg.end, lo + n)
            if a < b:
                for reader in seg.monitors:
                    reader.observe(rows[a - lo : b - lo], seg.position + (a - seg.start))

    def _apply(self, tensor: GGMLTensor, il: int, lp: LayerPlan, plan: ForwardPlan, kind: int = LAYER_OUT) -> None:
        what = node_name(kind, il)
        if tensor.type != GGML_TYPE_F32:
            raise RuntimeError(f"{what} is not float32")
        d, n = int(tensor.ne[0]), int(tensor.ne[1])
        # rows are read and written as one dense (n, d) float32 block: refuse anything else
        # rather than touch memory outside the tensor
        if (int(tensor.ne[2]), int(tensor.ne[3])) != (1, 1) or (int(tensor.nb[0]), int(tensor.nb[1])) != (4, 4 * d):
            raise RuntimeError(f"{what} is not a dense float32 matrix (ne {list(tensor.ne)}, nb {list(tensor.nb)})")
        arr, host = self._host_array(tensor, (n, d), what)
        rows = torch.from_numpy(arr)
        last = kind in PRUNED_AT_LAST and il == self.n_layer - 1 and n != plan.n_tokens
        lo = self._offsets.get((kind, il), 0)
        index = plan.output_rows[lo : lo + n] if last else None
        self._offsets[(kind, il)] = lo + n
        if lp.stash:
            # a copy: the graph reuses this node's memory once the MLP has read it
            self._stash[il] = rows.clone()

        written = False
        if lp.keys and plan.ctx is not None:
            # the context of the rows this node holds: a ubatch's window, or the output rows
            ctx = plan.ctx.select(index) if index is not None else plan.ctx.window(lo, lo + n)
            src = rows if lp.preset is None else rows - lp.preset
            cur = src
            for key in lp.keys:
                read = None
                if key in lp.read_input:
                    read = self._stash.get(il)
                    if read is None or read.shape[0] != n:
                        raise RuntimeError(f"{what}: the MLP input ffn_norm-{il} of these rows was not read")
                new = route(ctx, key, _PER_CALL, cur, read=read)
                if new is not None:
                    cur = new
            if cur is not src and lp.preset is None:
                rows.copy_(cur)
                written = True
        for seg in lp.segments:
            if index is None:
                a, b = max(seg.start, lo), min(seg.end, lo + n)
                if a >= b:
                    continue
                got, position = rows[a - lo : b - lo], seg.position + (a - seg.start)
            else:
                picked = [r for r, tok in enumerate(index) if seg.start <= tok < seg.end]
                if not picked:
                    continue
                # output rows of one request are its last positions, contiguous
                got = rows[picked[0] : picked[-1] + 1]
                position = seg.position + (index[picked[0]] - seg.start)
            for m in seg.monitors:
                m.observe(got, position)
        if not host and written:
            GGML_BASE.ggml_backend_tensor_set(ctypes.addressof(tensor), arr.ctypes.data, 0, arr.nbytes)


__all__ = [
    "ATTN_OUT",
    "EMBD",
    "FFN_NORM",
    "FFN_OUT",
    "KEY",
    "LAYER_OUT",
    "PRUNED_AT_LAST",
    "QUERY",
    "CaptureReader",
    "EvalTaps",
    "ForwardPlan",
    "LayerPlan",
    "MonitorSegment",
    "STAGE_MAX_BYTES",
    "Staged",
    "node_name",
]
