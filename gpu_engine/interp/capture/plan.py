"""One request's capture: its buffers (``RowBuffer``: hidden states, Q or K, allocated
once), its plan (``CapturePlan``: where rows go, what a batched step's stage hands it,
and the artifact it drains to when the request ends) and that artifact (``Artifact``:
the rows on the host, packed and written by ``pack``)."""

from __future__ import annotations

import errno
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ...api.artifacts import FORMAT, SIDECAR_KEY, TensorBytes, safetensors_layout, write_streamed
from ...api.errors import CaptureStoreFull, EngineError, GenerationFailed
from ...api.protocol import CaptureResult, CaptureSpec
from .shards import CapturePart
from .sizing import AttentionGeometry, rows_for


class RowBuffer:
    """One kind of captured rows (hidden states, Q or K) of one request: a buffer of
    (layers, rows it may take, *row shape) allocated once; a row's place is its position
    minus the first position captured (``last``: always row 0).  ``select``: the heads
    kept (index along the row's first dimension), or None for whole rows."""

    def __init__(
        self,
        positions: str,
        layers: list[int],
        shape: tuple[int, ...],
        *,
        prompt_len: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        select: list[int] | None = None,
    ) -> None:
        self.mode = positions
        self.layers = list(layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.layer_t = torch.tensor(self.layers, dtype=torch.long, device=device)
        self.select = torch.tensor(select, dtype=torch.long, device=device) if select is not None else None
        self.last_only = positions == "last"
        self.base = prompt_len - 1 if positions in ("completion", "last_prompt") else 0
        self.rows = rows_for(positions, prompt_len, max_tokens)
        self.buffer = torch.empty((len(self.layers), self.rows, *shape), dtype=dtype, device=device)
        self.filled_to = self.base  # positions below this are in the buffer (not ``last``)
        self.last_position = -1

    def _pick(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.select is None else rows.index_select(1, self.select)

    def observe(self, layer: int, rows: torch.Tensor, start: int) -> None:
        """Layer ``layer``'s rows for positions ``start, start + 1, …``."""
        i = self.index[layer]
        n = rows.shape[0]
        if self.last_only:
            self.buffer[i, 0].copy_(self._pick(rows[n - 1 : n])[0])
            self.last_position = start + n - 1
            return
        lo, hi = max(self.base, start), min(self.base + self.rows, start + n)
        if lo >= hi:
            return
        self.buffer[i, lo - self.base : hi - self.base].copy_(self._pick(rows[lo - start : hi - start]))
        self.filled_to = max(self.filled_to, hi)

    def take(self, stage: torch.Tensor, slot: int, position: int) -> None:
        """After a batched decode step: the row (``slot``, at ``position``) of every layer
        of this buffer, from the batch's stage (num_layers, slots, *row shape)."""
        self.take_span(stage, slot, slot + 1, position)

    def take_span(self, stage: torch.Tensor, lo: int, hi: int, start: int) -> None:
        """Rows ``lo:hi`` of a stage indexed by layer (num_layers, rows, *row shape),
        the positions ``start, start + 1, …``, for every layer of this buffer at once."""
        if self.last_only:
            self.buffer[:, 0].copy_(self._pick(stage[:, hi - 1].index_select(0, self.layer_t)))
            self.last_position = start + hi - lo - 1
            return
        a, b = max(self.base, start), min(self.base + self.rows, start + hi - lo)
        if a >= b:
            return
        rows = stage[:, lo + a - start : lo + b - start].index_select(0, self.layer_t)
        if self.select is not None:
            rows = rows.index_select(2, self.select)
        self.buffer[:, a - self.base : b - self.base].copy_(rows)
        self.filled_to = max(self.filled_to, b)

    def positions(self) -> list[int]:
        if self.last_only:
            return [self.last_position] if self.last_position >= 0 else []
        return list(range(self.base, self.filled_to))

    def drained(self) -> tuple[list[int], torch.Tensor]:
        positions = self.positions()
        return positions, self.buffer[:, : len(positions)].to("cpu")


class CapturePlan:
    """One request's capture (see the module doc).

    ``device=None``: the rows are taken elsewhere — by the model's workers in other
    processes or ranks (the vLLM backend) — so nothing is allocated here; each worker
    runs a plan of its own over what it holds (``for_shard``) and the driver's plan packs
    the parts they drained (``receive``)."""

    def __init__(
        self,
        spec: CaptureSpec,
        *,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | None,
        model: str,
        backend: str,
        steering_hash: str | None,
        geometry: AttentionGeometry | None = None,
        scaling: dict[int, float] | None = None,
    ) -> None:
        self.spec = spec
        self.request_id = request_id
        self.layers = list(spec.layers)
        kw: dict[str, Any] = {"prompt_len": prompt_len, "max_tokens": max_tokens, "dtype": dtype, "device": device}
        local = device is not None
        self.remote = not local
        self.hidden = RowBuffer(spec.positions, self.layers, (hidden_size,), **kw) if self.layers and local else None
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.q: RowBuffer | None = None
        self.k: RowBuffer | None = None
        self.qk_layers: list[int] = []
        self.heads: list[int] = []
        self.kv_heads: list[int] = []
        self.geometry = geometry
        self.scaling = scaling or {}
        self.parts: list[CapturePart] = []
        att = spec.attention
        if att is not None:
            if geometry is None:
                raise ValueError("an attention capture needs the model's AttentionGeometry")
            self.heads = att.heads if att.heads is not None else list(range(geometry.num_heads))
            self.kv_heads = geometry.kv_heads_for(self.heads)
            self.qk_layers = list(att.layers)
            if local:
                self.q = RowBuffer(
                    att.query_positions,
                    self.qk_layers,
                    (len(self.heads), geometry.head_dim),
                    **kw,
                    select=None if att.heads is None else self.heads,
                )
                every_kv = self.kv_heads == list(range(geometry.num_kv_heads))
                self.k = RowBuffer(
                    att.positions,
                    self.qk_layers,
                    (len(self.kv_heads), geometry.head_dim),
                    **kw,
                    select=None if every_kv else self.kv_heads,
                )
        self.qk_index = set(self.qk_layers)
        self.model = model
        self.backend = backend
        self.steering_hash = steering_hash
        self.dtype = dtype
        self.hidden_size = hidden_size
        # set by a runtime that packs artifacts on a thread of its own: ``finish`` then
        # only drains the rows and leaves the ``Artifact`` here for it
        self.deferred = False
        self.pending: Artifact | None = None

    def observe(self, layer: int, rows: torch.Tensor, start: int) -> None:
        """Block ``layer``'s output rows for positions ``start, start + 1, …``."""
        self.hidden.observe(layer, rows, start)  # type: ignore[union-attr]

    def wants_qk(self, layer: int) -> bool:
        return layer in self.qk_index

    def observe_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor, start: int) -> None:
        """Layer ``layer``'s rotated queries (rows, heads, head_dim) and new keys (rows,
        kv_heads, head_dim) for positions ``start, start + 1, …``."""
        self.observe_q(layer, q, start)
        self.observe_k(layer, k, start)

    def observe_q(self, layer: int, q: torch.Tensor, start: int) -> None:
        """Layer ``layer``'s rotated queries alone (a backend that reads Q and K apart)."""
        self.q.observe(layer, q, start)  # type: ignore[union-attr]

    def observe_k(self, layer: int, k: torch.Tensor, start: int) -> None:
        self.k.observe(layer, k, start)  # type: ignore[union-attr]

    def take(self, stage: torch.Tensor, slot: int, position: int) -> None:
        """After a batched decode step: this request's row (``slot``, at ``position``) of
        every captured layer, from the batch's stage."""
        if self.hidden is not None:
            self.hidden.take(stage, slot, position)

    def take_qk(self, q_stage: torch.Tensor, k_stage: torch.Tensor, slot: int, position: int) -> None:
        if self.q is not None:
            self.q.take(q_stage, slot, position)
            self.k.take(k_stage, slot, position)  # type: ignore[union-attr]

    def take_span(
        self,
        lo: int,
        hi: int,
        start: int,
        *,
        hidden: torch.Tensor | None = None,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
    ) -> None:
        """Rows ``lo:hi`` of stages indexed by layer — hidden (num_layers, rows,
        hidden_size), q (num_layers, rows, heads, head_dim), k likewise over the KV heads —
        at positions ``start, start + 1, …`` (a backend that stages a whole decode, prefill
        included, before handing rows over: ``backends/llamacpp/taps.py``)."""
        if hidden is not None and self.hidden is not None:
            self.hidden.take_span(hidden, lo, hi, start)
        if q is not None and self.q is not None:
            self.q.take_span(q, lo, hi, start)
            self.k.take_span(k, lo, hi, start)  # type: ignore[union-attr, arg-type]

    def positions(self) -> list[int]:
        return self.hidden.positions() if self.hidden is not None else []

    def drain(self) -> dict[str, torch.Tensor]:
        """The rows taken so far, on the host: ``layer.<L>`` and ``positions`` for hidden
        states, ``q.<L>``, ``k.<L>``, ``q_positions`` and ``k_positions`` for Q/K (this
        plan's heads), the positions as int64."""
        tensors: dict[str, torch.Tensor] = {}
        if self.hidden is not None:
            positions, hidden = self.hidden.drained()
            tensors.update({f"layer.{layer}": hidden[i].contiguous() for i, layer in enumerate(self.layers)})
            tensors["positions"] = torch.tensor(positions, dtype=torch.int64)
        if self.q is not None and self.k is not None:
            q_pos, q = self.q.drained()
            k_pos, k = self.k.drained()
            for i, layer in enumerate(self.qk_layers):
                tensors[f"q.{layer}"] = q[i].contiguous()
                tensors[f"k.{layer}"] = k[i].contiguous()
            tensors["q_positions"] = torch.tensor(q_pos, dtype=torch.int64)
            tensors["k_positions"] = torch.tensor(k_pos, dtype=torch.int64)
        return tensors

    def receive(self, parts: list[CapturePart]) -> None:
        """The parts the workers drained for this request (``device=None`` plans)."""
        self.parts.extend(parts)

    def _merged(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        """A ``device=None`` plan's tensors from its parts: hidden states from the parts
        that hold them (TP rank 0 of each pipeline stage: every TP rank has the same
        stream); Q/K as ``q.<L>``/``k.<L>`` when one part holds every asked head, else as
        one shard per part (``q.<L>.tp<rank>``) with the shards' global head ranges —
        ``artifacts.load_capture`` merges them on read."""
        from safetensors.torch import load

        tensors: dict[str, torch.Tensor] = {}
        shards: list[dict[str, Any]] = []
        qk_parts = [p for p in self.parts if p.heads]
        for part in sorted(self.parts, key=lambda p: p.rank):
            got = load(part.data)
            for name, value in got.items():
                if name.startswith("layer.") or (name == "positions" and name not in tensors):
                    tensors[name] = value
                elif name in ("q_positions", "k_positions"):
                    tensors.setdefault(name, value)
                elif len(qk_parts) == 1:
                    tensors[name] = value
                else:
                    tensors[f"{name}.tp{part.rank}"] = value
            if part.heads and len(qk_parts) > 1:
                shards.append({"rank": part.rank, "heads": list(part.heads), "kv_heads": list(part.kv_heads)})
        # a request no worker ran (cancelled while queued in vLLM) still gets its (empty) tensors
        empty = torch.zeros(0, dtype=torch.int64)
        if self.layers and "positions" not in tensors:
            tensors["positions"] = empty
            tensors.update(
                {f"layer.{layer}": torch.empty((0, self.hidden_size), dtype=self.dtype) for layer in self.layers}
            )
        if self.qk_layers and not qk_parts and self.geometry is not None:
            d = self.geometry.head_dim
            tensors["q_positions"], tensors["k_positions"] = empty, empty.clone()
            for layer in self.qk_layers:
                tensors[f"q.{layer}"] = torch.empty((0, len(self.heads), d), dtype=self.dtype)
                tensors[f"k.{layer}"] = torch.empty((0, len(self.kv_heads), d), dtype=self.dtype)
        return tensors, shards

    def artifact(self, *, prompt_ids: list[int], generated: list[int], steering_counts: Sequence[Any] = ()) -> Artifact:
        """The rows taken so far drained to the host (the one device-to-host copy, on the
        calling thread), nothing serialised or written yet: ``Artifact.pack`` does that,
        on whichever thread the caller chooses.  A ``device=None`` plan's parts are host
        bytes already; they are merged when packed."""
        return Artifact(
            self,
            None if self.remote else self.drain(),
            prompt_ids=list(prompt_ids),
            generated=list(generated),
            # plain data now: the hooks' counts may change once the request is gone
            steering_apply_count=[
                {"sae_id": c.sae_id, "layer": c.layer, "count": c.count, "modes": dict(c.modes)}
                for c in steering_counts
            ],
        )

    def finish(
        self, *, prompt_ids: list[int], generated: list[int], steering_counts: Sequence[Any] = ()
    ) -> CaptureResult | None:
        """At the request's end (``Sequence.finish``): its artifact packed now, or — for a
        plan whose runtime packs elsewhere (``deferred``, set by the engine, which hands
        ``pending`` to its capture writer) — drained to the host and kept as ``pending``
        (None returned)."""
        art = self.artifact(prompt_ids=prompt_ids, generated=generated, steering_counts=steering_counts)
        if self.deferred:
            self.pending = art
            return None
        return art.pack()

    def result(
        self, *, prompt_ids: list[int], generated: list[int], steering_counts: Sequence[Any] = ()
    ) -> CaptureResult:
        """Drain the rows taken so far (or pack the workers' parts) into the artifact, on
        this thread; ``steering_counts``: the request's ``SteeringCount``s, recorded beside
        its hash."""
        return self.artifact(prompt_ids=prompt_ids, generated=generated, steering_counts=steering_counts).pack()


_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
}


def _tensor_bytes(name: str, t: torch.Tensor) -> TensorBytes:
    """A host tensor's own memory, as the streamed writer takes it (no copy when it is
    contiguous already, as drained rows are)."""
    t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return TensorBytes(name, _ST_DTYPES[t.dtype], tuple(t.shape), raw, t.numel() * t.element_size())


class Artifact:
    """A finished request's capture on the host, not packed yet (``CapturePlan.artifact``).
    ``pack`` builds the sidecar and the safetensors file and returns the
    ``CaptureResult``: inline bytes when small, else the file written under the spec's
    directory (streamed from the rows' memory, temporary name then rename, so the id
    names a whole file or none).  Packing touches nothing of the running batch: the
    engine runs it on its capture writer's thread (``gpu_engine.runtime.capture_writer``).
    A file that cannot be written raises ``CaptureWriteFailed``, or ``CaptureDiskFull``
    when the disk has no room."""

    def __init__(
        self,
        plan: CapturePlan,
        tensors: dict[str, torch.Tensor] | None,
        *,
        prompt_ids: list[int],
        generated: list[int],
        steering_apply_count: list[dict[str, Any]],
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.prompt_ids = prompt_ids
        self.generated = generated
        self.steering_apply_count = steering_apply_count
        self.created_at = time.time()
        self.capture_id = uuid.uuid4().hex

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    def pack(self) -> CaptureResult:
        from safetensors.torch import save

        plan = self.plan
        full = self.prompt_ids + self.generated
        shards: list[dict[str, Any]] = []
        if self.tensors is None:
            tensors, shards = plan._merged()
        else:
            tensors = dict(self.tensors)
        positions: list[int] = []
        token_ids: list[int] = []
        if "positions" in tensors:
            positions = [p for p in tensors["positions"].tolist() if p < len(full)]
            token_ids = [full[p] for p in positions]
            tensors["positions"] = tensors["positions"][: len(positions)]
            for layer in plan.layers:
                tensors[f"layer.{layer}"] = tensors[f"layer.{layer}"][: len(positions)].contiguous()
            tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
        capture_id = self.capture_id
        meta: dict[str, Any] = {
            "format": FORMAT,
            "capture_id": capture_id,
            "request_id": plan.request_id,
            "model": plan.model,
            "backend": plan.backend,
            "layers": plan.layers,
            "positions": plan.spec.positions,
            "read_point": "block_output_after_steering",
            "row_positions": positions,
            "token_ids": token_ids,
            "prompt_token_ids": list(self.prompt_ids),
            "completion_token_ids": list(self.generated),
            "dtype": str(plan.dtype).removeprefix("torch."),
            "hidden_size": int(plan.hidden_size),
            "rows": len(positions),
            "steering_hash": plan.steering_hash,
            # the forward passes in which the steering was added, as /v1 reports them
            "steering_apply_count": self.steering_apply_count,
            "created_at": self.created_at,
        }
        if plan.spec.attention is not None and plan.geometry is not None:
            att = plan.spec.attention
            meta["attention"] = {
                "layers": plan.qk_layers,
                "heads": plan.heads,
                "kv_heads": plan.kv_heads,
                "num_heads": plan.geometry.num_heads,
                "num_kv_heads": plan.geometry.num_kv_heads,
                "head_dim": plan.geometry.head_dim,
                "positions": att.positions,
                "q_positions": att.query_positions,
                "q_row_positions": tensors["q_positions"].tolist() if "q_positions" in tensors else [],
                "k_row_positions": tensors["k_positions"].tolist() if "k_positions" in tensors else [],
                "scaling": {str(layer): plan.scaling.get(layer) for layer in plan.qk_layers},
                "read_point": "attention_input_after_position_encoding",
            }
            if shards:
                meta["attention"]["shards"] = shards
        metadata = {SIDECAR_KEY: json.dumps(meta, sort_keys=True)}
        parts = [_tensor_bytes(name, t) for name, t in tensors.items()]
        prefix, _ = safetensors_layout(parts, metadata)
        size = len(prefix) + sum(p.nbytes for p in parts)
        spec = plan.spec
        if spec.directory is None or size <= spec.inline_max_bytes:
            data = save(tensors, metadata=metadata)
            return CaptureResult(capture_id, len(data), meta, data=data)
        try:
            name, size = write_streamed(spec.directory, capture_id, parts, metadata, meta)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CaptureDiskFull(nbytes=size) from exc
            raise CaptureWriteFailed(exc) from exc
        return CaptureResult(capture_id, size, meta, file=name)


class CaptureDiskFull(CaptureStoreFull):
    """The disk under the capture directory had no room for a finished capture (ENOSPC,
    EDQUOT) although the quota check passed: ``capture_store_full``, as a request refused
    by that check."""

    def __init__(self, *, nbytes: int) -> None:
        EngineError.__init__(
            self,
            f"the capture store is full: the disk had no room for this capture's {nbytes} bytes; "
            "delete stored captures (DELETE /api/captures/{id}), wait for expired ones to be pruned, "
            "or capture less",
            details={"param": "capture", "estimate_bytes": nbytes, "room_bytes": 0, "reason": "disk_full"},
        )


class CaptureWriteFailed(GenerationFailed):
    """A finished capture's file could not be written (permissions, a missing mount, an
    I/O error): the request ends with ``generation_failed`` naming the system's reason,
    never the path."""

    def __init__(self, exc: OSError) -> None:
        reason = exc.strerror or type(exc).__name__
        super().__init__(
            f"the capture could not be stored: {reason}",
            details={"param": "capture", "errno": errno.errorcode.get(exc.errno or 0, "")},
        )
