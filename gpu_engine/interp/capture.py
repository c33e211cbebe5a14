"""Hidden-state capture per request, inside batches: the plan, the hook, the drain.

What is captured: the output of decoder block ``L`` after every steering applied to it
(a ``resid_post`` attachment at ``L`` and a ``resid_pre`` one at ``L + 1`` both hook that
output), i.e. exactly what block ``L + 1`` reads.  Steering inside the block (``attn_out``,
``mlp_out``) is part of it too.  HF's ``output_hidden_states[L + 1]`` is the same tensor
for every layer but the last, which HF reports after the final norm.

How (the "aperture"):

- a request's ``CapturePlan`` owns one buffer allocated when it starts, sized for every
  row it may take (``rows_for``; checked against ``CaptureSpec.max_bytes`` before
  anything runs): (layers, rows, hidden_size) in the model's dtype.  A row's place is its
  position minus the first position captured (``last``: always row 0), so there is no
  per-token Python object, only a high-water mark;
- the capture hook (``CaptureHook``) sits on block ``L`` only while some running request
  captures ``L`` (``HookManager.arm_capture``, reference-counted) and is kept the last
  hook on its module, so it reads the steered stream.  With no capture armed there is no
  hook at all: the unarmed path is the code that ran before;
- prefill (and the serial path) write straight into the plan's buffer; a batched decode
  step writes every row into the batch's stage with one ``index_copy_`` per captured
  layer (``BatchContext.capture_stage``: (num_layers, slots, hidden_size)), then each
  capturing request copies its slot's column into its buffer (``CapturePlan.take``);
- when the request ends (finished, stopped or cancelled) ``result`` drains the rows it has
  to the host and packs the artifact (``gpu_engine.api.artifacts``): inline when small, else
  written under the spec's directory.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from ..api.artifacts import FORMAT, SIDECAR_KEY, write_files
from ..api.protocol import CaptureResult, CaptureSpec

ROW_META_BYTES = 16  # positions + token_ids, int64 each
QK_ROW_META_BYTES = 8  # q_positions / k_positions, int64


def rows_for(positions: str, prompt_len: int, max_tokens: int) -> int:
    """The most rows a capture can take: ``last`` and ``last_prompt`` one, ``prompt`` the
    prompt, ``completion`` one per generated token, ``all`` every row computed (the final
    token is never fed)."""
    if positions in ("last", "last_prompt"):
        return 1
    if positions == "prompt":
        return prompt_len
    if positions == "completion":
        return max(max_tokens, 1)
    return prompt_len + max(max_tokens, 1) - 1


@dataclass(frozen=True)
class AttentionGeometry:
    """The loaded model's attention heads, for Q/K capture."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_heads_for(self, heads: list[int]) -> list[int]:
        """The KV heads query ``heads`` read (transformers' ``repeat_kv`` order)."""
        return sorted({h // self.group for h in heads})


def estimate_bytes(
    spec: CaptureSpec,
    *,
    prompt_len: int,
    max_tokens: int,
    hidden_size: int,
    itemsize: int,
    geometry: AttentionGeometry | None = None,
) -> tuple[int, int]:
    """(worst-case tensor bytes of the artifact, rows of the largest part)."""
    rows = rows_for(spec.positions, prompt_len, max_tokens) if spec.layers else 0
    total = rows * (len(spec.layers) * hidden_size * itemsize + ROW_META_BYTES)
    att = spec.attention
    if att is not None and geometry is not None:
        heads = att.heads if att.heads is not None else list(range(geometry.num_heads))
        q_rows = rows_for(att.query_positions, prompt_len, max_tokens)
        k_rows = rows_for(att.positions, prompt_len, max_tokens)
        width = geometry.head_dim * itemsize * len(att.layers)
        total += q_rows * (len(heads) * width + QK_ROW_META_BYTES)
        total += k_rows * (len(geometry.kv_heads_for(heads)) * width + QK_ROW_META_BYTES)
        rows = max(rows, q_rows, k_rows)
    return total, rows


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

    def result(
        self, *, prompt_ids: list[int], generated: list[int], steering_counts: Sequence[Any] = ()
    ) -> CaptureResult:
        """Drain the rows taken so far (or pack the workers' parts) into the artifact;
        ``steering_counts``: the request's ``SteeringCount``s, recorded beside its hash."""
        from safetensors.torch import save

        full = list(prompt_ids) + list(generated)
        shards: list[dict[str, Any]] = []
        if self.remote:
            tensors, shards = self._merged()
        else:
            tensors = self.drain()
        positions: list[int] = []
        token_ids: list[int] = []
        if "positions" in tensors:
            positions = [p for p in tensors["positions"].tolist() if p < len(full)]
            token_ids = [full[p] for p in positions]
            tensors["positions"] = tensors["positions"][: len(positions)]
            for layer in self.layers:
                tensors[f"layer.{layer}"] = tensors[f"layer.{layer}"][: len(positions)].contiguous()
            tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
        capture_id = uuid.uuid4().hex
        meta: dict[str, Any] = {
            "format": FORMAT,
            "capture_id": capture_id,
            "request_id": self.request_id,
            "model": self.model,
            "backend": self.backend,
            "layers": self.layers,
            "positions": self.spec.positions,
            "read_point": "block_output_after_steering",
            "row_positions": positions,
            "token_ids": token_ids,
            "prompt_token_ids": list(prompt_ids),
            "completion_token_ids": list(generated),
            "dtype": str(self.dtype).removeprefix("torch."),
            "hidden_size": int(self.hidden_size),
            "rows": len(positions),
            "steering_hash": self.steering_hash,
            # the forward passes in which the steering was added, as /v1 reports them
            "steering_apply_count": [
                {"sae_id": c.sae_id, "layer": c.layer, "count": c.count, "modes": dict(c.modes)}
                for c in steering_counts
            ],
            "created_at": time.time(),
        }
        if self.spec.attention is not None and self.geometry is not None:
            att = self.spec.attention
            meta["attention"] = {
                "layers": self.qk_layers,
                "heads": self.heads,
                "kv_heads": self.kv_heads,
                "num_heads": self.geometry.num_heads,
                "num_kv_heads": self.geometry.num_kv_heads,
                "head_dim": self.geometry.head_dim,
                "positions": att.positions,
                "q_positions": att.query_positions,
                "q_row_positions": tensors["q_positions"].tolist() if "q_positions" in tensors else [],
                "k_row_positions": tensors["k_positions"].tolist() if "k_positions" in tensors else [],
                "scaling": {str(layer): self.scaling.get(layer) for layer in self.qk_layers},
                "read_point": "attention_input_after_position_encoding",
            }
            if shards:
                meta["attention"]["shards"] = shards
        data = save(tensors, metadata={SIDECAR_KEY: json.dumps(meta, sort_keys=True)})
        spec = self.spec
        if spec.directory is None or len(data) <= spec.inline_max_bytes:
            return CaptureResult(capture_id, len(data), meta, data=data)
        name = write_files(spec.directory, capture_id, data, meta)
        return CaptureResult(capture_id, len(data), meta, file=name)


@dataclass(frozen=True)
class CapturePart:
    """What one worker drained for one request: ``data``, the safetensors bytes of its
    plan's ``drain()``; ``rank``, its tensor-parallel rank; ``heads``/``kv_heads``, the
    global query and KV heads its ``q.<L>``/``k.<L>`` hold (empty: no Q/K here)."""

    rank: int
    data: bytes
    heads: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank holds: query heads
    ``[head_start, head_start + num_heads)`` and KV heads ``[kv_start, kv_start + num_kv_heads)``
    (a KV head replicated over several ranks when there are fewer KV heads than ranks)."""

    rank: int
    head_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, rank: int, size: int, *, num_heads: int, num_kv_heads: int, head_dim: int) -> HeadShard:
        """Rank ``rank`` of ``size``'s heads as Megatron-style column parallelism splits them
        (vLLM's ``QKVParallelLinear``)."""
        local = num_heads // size
        if num_kv_heads >= size:
            local_kv, kv_start = num_kv_heads // size, rank * (num_kv_heads // size)
        else:
            local_kv, kv_start = 1, rank // (size // num_kv_heads)
        return cls(rank, rank * local, local, kv_start, local_kv, head_dim)


def for_shard(
    spec: CaptureSpec, shard: HeadShard, *, hidden: bool, held: set[int] | None = None
) -> tuple[CaptureSpec | None, list[int], list[int]]:
    """The part of ``spec`` one worker takes: hidden layers only where ``hidden`` (one TP
    rank suffices) and it holds the layer (``held``: None = all), the asked heads it holds,
    renumbered local to its shard.  Returns (the local spec or None when it takes nothing,
    the global query heads and the global KV heads its Q/K rows are)."""

    def holds(layer: int) -> bool:
        return held is None or layer in held

    layers = [layer for layer in spec.layers if hidden and holds(layer)]
    att = spec.attention
    local_att = None
    heads: list[int] = []
    kv_heads: list[int] = []
    if att is not None:
        qk_layers = [layer for layer in att.layers if holds(layer)]
        wanted = att.heads if att.heads is not None else range(shard.head_start, shard.head_start + shard.num_heads)
        local = [h - shard.head_start for h in wanted if shard.head_start <= h < shard.head_start + shard.num_heads]
        if qk_layers and local:
            local_att = msgspec.structs.replace(
                att, layers=qk_layers, heads=None if len(local) == shard.num_heads else local
            )
            geometry = AttentionGeometry(shard.num_heads, shard.num_kv_heads, shard.head_dim)
            heads = [shard.head_start + h for h in local]
            kv_heads = [shard.kv_start + kv for kv in geometry.kv_heads_for(local)]
    if not layers and local_att is None:
        return None, [], []
    return msgspec.structs.replace(spec, layers=layers, attention=local_att), heads, kv_heads


def is_pair(output: Any) -> bool:
    """Whether a block returned ``(hidden, residual)`` (vLLM's Llama-family layers) rather
    than the stream itself (vLLM's GPT-2 blocks add their residual inside): a hook
    installed with ``residual_pair`` on a block of the other kind treats it as a plain
    block."""
    return (
        isinstance(output, tuple)
        and len(output) >= 2
        and isinstance(output[1], torch.Tensor)
        and output[1].shape == output[0].shape
    )


class CaptureHook:
    """The forward hook on one block while a capture of it is armed; reads the manager's
    current ``BatchContext`` and never changes the output.  ``residual_pair``: the block
    returns ``(hidden, residual)`` (vLLM's decoder layers) and the stream is their sum."""

    def __init__(self, layer: int, manager: Any, *, residual_pair: bool = False) -> None:
        self.layer = layer
        self.manager = manager
        self.residual_pair = residual_pair

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx = self.manager.current
        if ctx is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        stage = ctx.capture_stage
        if stage is None and not any(
            s.request.capture is not None and self.layer in s.request.capture.index for s in ctx.segments
        ):
            return None
        if self.residual_pair and is_pair(output):
            hidden = hidden + output[1]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if stage is not None:  # batched decode: every row into its slot, one copy
            slots = ctx.row_slots
            stage[self.layer].index_copy_(0, slots, flat[: slots.shape[0]])
            return None
        for seg in ctx.segments:
            plan = seg.request.capture
            if plan is not None and self.layer in plan.index:
                plan.observe(self.layer, flat[seg.row_start : seg.row_end], seg.start_position)
        return None


def route_qk(ctx: Any, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
    """Layer ``layer``'s rotated queries (rows, heads, head_dim) and new keys (rows,
    kv_heads, head_dim), rows in the batch's flattened order, to the requests capturing
    them: every row into its slot of the batch's stage (batched decode), else each
    capturing request's segment into its plan.  The attention taps of every backend call
    this."""
    stage = ctx.qk_stage
    if stage is not None:
        slots = ctx.row_slots
        n = slots.shape[0]
        stage[0][layer].index_copy_(0, slots, q[:n])
        stage[1][layer].index_copy_(0, slots, k[:n])
        return
    for seg in ctx.segments:
        plan = seg.request.capture
        if plan is not None and plan.wants_qk(layer):
            plan.observe_qk(layer, q[seg.row_start : seg.row_end], k[seg.row_start : seg.row_end], seg.start_position)


@contextmanager
def armed(manager: Any, runner: Any, plan: CapturePlan | None) -> Iterator[None]:
    """The plan's layers armed on ``manager`` (``HookManager``) — block hooks for hidden
    states, attention taps for Q/K (``runner.arm_qk``) — and disarmed on the way out
    whatever happens (the serial path: one request at a time)."""
    done: list[int] = []
    done_qk: list[int] = []
    try:
        for layer in plan.layers if plan is not None else ():
            manager.arm_capture(layer, runner.block(layer)[0])
            done.append(layer)
        for layer in plan.qk_layers if plan is not None else ():
            runner.arm_qk(layer)
            done_qk.append(layer)
        yield
    finally:
        for layer in done:
            manager.disarm_capture(layer)
        for layer in done_qk:
            runner.disarm_qk(layer)


__all__ = [
    "AttentionGeometry",
    "CaptureHook",
    "CapturePart",
    "CapturePlan",
    "HeadShard",
    "RowBuffer",
    "armed",
    "estimate_bytes",
    "for_shard",
    "route_qk",
    "rows_for",
]
