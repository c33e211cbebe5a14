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
  to the host and packs the artifact (``gpu_engine.artifacts``): inline when small, else
  written under the spec's directory.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .artifacts import FORMAT, SIDECAR_KEY, write_files
from .protocol import CaptureResult, CaptureSpec

ROW_META_BYTES = 16  # positions + token_ids, int64 each


def rows_for(positions: str, prompt_len: int, max_tokens: int) -> int:
    """The most rows a capture can take: ``last`` one, ``prompt`` the prompt, ``completion``
    one per generated token, ``all`` every row computed (the final token is never fed)."""
    if positions == "last":
        return 1
    if positions == "prompt":
        return prompt_len
    if positions == "completion":
        return max(max_tokens, 1)
    return prompt_len + max(max_tokens, 1) - 1


def estimate_bytes(spec: CaptureSpec, *, prompt_len: int, max_tokens: int, hidden_size: int,
                   itemsize: int) -> tuple[int, int]:
    """(worst-case tensor bytes of the artifact, rows)."""
    rows = rows_for(spec.positions, prompt_len, max_tokens)
    return rows * (len(spec.layers) * hidden_size * itemsize + ROW_META_BYTES), rows


class CapturePlan:
    """One request's capture (see the module doc)."""

    def __init__(self, spec: CaptureSpec, *, request_id: str, prompt_len: int, max_tokens: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, model: str, backend: str,
                 steering_hash: str | None) -> None:
        self.spec = spec
        self.request_id = request_id
        self.layers = list(spec.layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.layer_t = torch.tensor(self.layers, dtype=torch.long, device=device)
        self.last_only = spec.positions == "last"
        self.base = prompt_len - 1 if spec.positions == "completion" else 0
        self.rows = rows_for(spec.positions, prompt_len, max_tokens)
        self.buffer = torch.empty((len(self.layers), self.rows, hidden_size), dtype=dtype, device=device)
        self.filled_to = self.base  # positions below this are in the buffer (not ``last``)
        self.last_position = -1
        self.model = model
        self.backend = backend
        self.steering_hash = steering_hash

    def _window(self, start: int, n: int) -> tuple[int, int]:
        return max(self.base, start), min(self.base + self.rows, start + n)

    def observe(self, layer: int, rows: torch.Tensor, start: int) -> None:
        """Block ``layer``'s output rows for positions ``start, start + 1, …``."""
        i = self.index[layer]
        n = rows.shape[0]
        if self.last_only:
            self.buffer[i, 0].copy_(rows[n - 1])
            self.last_position = start + n - 1
            return
        lo, hi = self._window(start, n)
        if lo >= hi:
            return
        self.buffer[i, lo - self.base : hi - self.base].copy_(rows[lo - start : hi - start])
        self.filled_to = max(self.filled_to, hi)

    def take(self, stage: torch.Tensor, slot: int, position: int) -> None:
        """After a batched decode step: this request's row (``slot``, at ``position``) of
        every captured layer, from the batch's stage."""
        if self.last_only:
            dest = 0
            self.last_position = position
        else:
            if not self.base <= position < self.base + self.rows:
                return
            dest = position - self.base
            self.filled_to = max(self.filled_to, position + 1)
        self.buffer[:, dest].copy_(stage.index_select(0, self.layer_t)[:, slot])

    def positions(self) -> list[int]:
        if self.last_only:
            return [self.last_position] if self.last_position >= 0 else []
        return list(range(self.base, self.filled_to))

    def result(self, *, prompt_ids: list[int], generated: list[int]) -> CaptureResult:
        """Drain the rows taken so far and pack the artifact."""
        from safetensors.torch import save

        positions = self.positions()
        n = len(positions)
        hidden = self.buffer[:, :n].to("cpu")
        full = list(prompt_ids) + list(generated)
        token_ids = [full[p] for p in positions]
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
            "dtype": str(self.buffer.dtype).removeprefix("torch."),
            "hidden_size": int(self.buffer.shape[-1]),
            "rows": n,
            "steering_hash": self.steering_hash,
            "created_at": time.time(),
        }
        tensors = {f"layer.{layer}": hidden[i].contiguous() for i, layer in enumerate(self.layers)}
        tensors["positions"] = torch.tensor(positions, dtype=torch.int64)
        tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
        data = save(tensors, metadata={SIDECAR_KEY: json.dumps(meta, sort_keys=True)})
        spec = self.spec
        if spec.directory is None or len(data) <= spec.inline_max_bytes:
            return CaptureResult(capture_id, len(data), meta, data=data)
        name = write_files(spec.directory, capture_id, data, meta)
        return CaptureResult(capture_id, len(data), meta, file=name)


class CaptureHook:
    """The forward hook on one block while a capture of it is armed; reads the manager's
    current ``BatchContext`` and never changes the output."""

    def __init__(self, layer: int, manager: Any) -> None:
        self.layer = layer
        self.manager = manager

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx = self.manager.current
        if ctx is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        flat = hidden.reshape(-1, hidden.shape[-1])
        stage = ctx.capture_stage
        if stage is not None:  # batched decode: every row into its slot, one copy
            slots = ctx.row_slots
            stage[self.layer].index_copy_(0, slots, flat[: slots.shape[0]])
            return None
        for seg in ctx.segments:
            plan = seg.request.capture
            if plan is not None and self.layer in plan.index:
                plan.observe(self.layer, flat[seg.row_start : seg.row_end], seg.start_position)
        return None


@contextmanager
def armed(manager: Any, block: Callable[[int], torch.nn.Module], plan: CapturePlan | None) -> Iterator[None]:
    """The plan's layers armed on ``manager`` (``HookManager``) for the block, disarmed on
    the way out whatever happens (the serial path: one request at a time)."""
    done: list[int] = []
    try:
        for layer in plan.layers if plan is not None else ():
            manager.arm_capture(layer, block(layer))
            done.append(layer)
        yield
    finally:
        for layer in done:
            manager.disarm_capture(layer)


__all__ = ["CaptureHook", "CapturePlan", "armed", "estimate_bytes", "rows_for"]
