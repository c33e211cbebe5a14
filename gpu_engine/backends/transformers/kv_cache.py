"""The batched KV cache: one preallocated, left-padded slab per layer.

Layout per layer: keys and values of shape ``(row_capacity, kv_heads, slot_capacity,
head_dim)``.  All running rows share one slot counter ``length``: the token a decode
step feeds goes into slot ``length`` for every row, so a row's real tokens fill the
contiguous slots ``start[row] .. length-1`` and the slots before ``start[row]`` are
padding (zeros, masked out).  A row's token at slot ``s`` has sequence position
``s - start[row]``; the decode step passes those per-row positions as ``position_ids``
and a 2-D padding mask, and transformers builds the causal (and sliding-window) masks
from them — in slot space, which equals position space because real slots are
contiguous.

Why not transformers' ``DynamicCache``: it grows by ``torch.cat`` (the whole cache is
copied every step), it cannot drop a finished row or admit a new one without rebuilding,
and its sliding-window layers trim per layer, so merging a newly prefilled request into
a running batch would need per-layer-type code.  Here a decode step writes one slot in
place, a finished row is swapped out with one row copy, and a new request is copied in
once after its own (unpadded) prefill.  Every layer is a full-attention layer for the
cache; sliding-window models get their window from the mask (correct, a little more
attention work past the window).

Fixed mode (KV_CACHE_MODE=static, and always under TORCH_COMPILE: ``compiled.py``): the
slab is allocated for every row the batch may hold at once, and a decode step runs over
the slab's whole slot capacity with the rows padded to a power-of-two bucket
(``fixed_step_inputs``): the step's keys and values are written at a slot given as a
tensor, the mask hides the slots past the step and each row's padding, and a padding row
sees only its own slot.  Its shapes then change only when the bucket or the slot capacity
does, which is what lets a compiled step run without recompiling as sequences grow.

The cache only stores tensors.  Which request owns which row is the scheduler's business.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

MIN_SLOTS = 64
# left padding common to every row is dropped once it is at least this many slots and at
# least a quarter of the cache: attention reads every slot, so dead slots cost time
TRIM_MIN_SLOTS = 32


class _SlabLayer(DynamicLayer):
    """One layer's slab; its ``update`` writes the step's keys/values in place."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: BatchKVCache) -> None:
        super().__init__()
        self.owner = owner
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("BatchKVCache layers are allocated by merge(), not by a forward pass")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        if o.fixed_write is not None:  # a fixed-shape step (module doc): every slot, in place
            slot, rows = o.fixed_write
            self.k_buf[:rows].index_copy_(2, slot, key_states)  # type: ignore[index]
            self.v_buf[:rows].index_copy_(2, slot, value_states)  # type: ignore[index]
            return self.k_buf[:rows], self.v_buf[:rows]  # type: ignore[index]
        n, q = key_states.shape[0], key_states.shape[-2]
        lo, hi = o.length, o.length + q
        self.k_buf[:n, :, lo:hi] = key_states  # type: ignore[index]
        self.v_buf[:n, :, lo:hi] = value_states  # type: ignore[index]
        self.keys = self.k_buf[:n, :, :hi]  # type: ignore[index]
        self.values = self.v_buf[:n, :, :hi]  # type: ignore[index]
        return self.keys, self.values

    def get_seq_length(self) -> Any:
        if self.owner.fixed_write is not None:
            # the slot written, as a tensor (as StaticLayer does): the mask's query offset,
            # read without a guard on the step's length
            return self.owner.fixed_write[0][0]
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.owner.fixed_write is not None:
            return self.owner.slot_capacity, 0
        return self.owner.length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class BatchKVCache(Cache):
    """Left-padded slab cache for ``rows`` running sequences (see the module doc)."""

    def __init__(self, num_layers: int, *, device: torch.device, dtype: torch.dtype, fixed_rows: int = 0) -> None:
        super().__init__(layers=[_SlabLayer(self) for _ in range(num_layers)])
        self.device = device
        self.dtype = dtype
        # fixed mode (module doc): the rows allocated at once; 0 = the growing layout
        self.fixed_rows = fixed_rows
        # during a fixed-shape step: (the slot written, as a (1,) tensor; the rows run)
        self.fixed_write: tuple[torch.Tensor, int] | None = None
        self.rows = 0
        self.length = 0
        self.row_capacity = 0
        self.slot_capacity = 0
        # first real slot of each row (host copy: the scheduler reads it every step)
        self.start: list[int] = []

    # ------------------------------------------------------------------ shape

    def _allocate(self, rows: int, slots: int, shift: int = 0) -> None:
        """(Re)allocate every slab for ``rows × slots``, moving current data ``shift`` slots right."""
        for layer in self.layers:
            old_k, old_v = layer.k_buf, layer.v_buf
            if old_k is None:
                continue
            heads, head_dim = old_k.shape[1], old_k.shape[3]
            k = torch.zeros((rows, heads, slots, head_dim), dtype=old_k.dtype, device=old_k.device)
            v = torch.zeros((rows, heads, slots, head_dim), dtype=old_v.dtype, device=old_v.device)
            if self.rows and self.length:
                k[: self.rows, :, shift : shift + self.length] = old_k[: self.rows, :, : self.length]
                v[: self.rows, :, shift : shift + self.length] = old_v[: self.rows, :, : self.length]
            layer.k_buf, layer.v_buf = k, v
        self.row_capacity, self.slot_capacity = rows, slots

    def _ensure(self, rows: int, slots: int, shift: int = 0) -> None:
        if rows <= self.row_capacity and slots <= self.slot_capacity and shift == 0:
            return
        new_rows = max(rows, self.row_capacity)
        if rows > self.row_capacity:
            new_rows = max(rows, 2 * self.row_capacity, 1)
        new_slots = self.slot_capacity
        if slots > self.slot_capacity:
            new_slots = max(slots, 2 * self.slot_capacity, MIN_SLOTS)
        if shift and new_rows == self.row_capacity and new_slots == self.slot_capacity:
            # in-place right shift (overlapping): go through a copy
            for layer in self.layers:
                if layer.k_buf is None:
                    continue
                for buf in (layer.k_buf, layer.v_buf):
                    live = buf[: self.rows, :, : self.length].clone()
                    buf[: self.rows, :, : shift + self.length].zero_()
                    buf[: self.rows, :, shift : shift + self.length] = live
            return
        self._allocate(new_rows, new_slots, shift)

    def reserve(self, extra_slots: int = 1) -> None:
        """Make room for the next ``extra_slots`` decode slots (call before a step)."""
        if self.rows:
            self._ensure(self.rows, self.length + extra_slots)

    # ------------------------------------------------------------------ rows

    def merge(self, past: Any, *, row: int = 0, skip: int = 0) -> int:
        """Append one prefilled sequence — row ``row`` of a prefill cache, without its first
        ``skip`` (left-padding) positions; returns its row here."""
        per_layer = [
            (layer.keys[row : row + 1, :, skip:], layer.values[row : row + 1, :, skip:]) for layer in past.layers
        ]
        if len(per_layer) != len(self.layers):
            raise RuntimeError(f"prefill cache has {len(per_layer)} layers, the batch cache {len(self.layers)}")
        p = int(per_layer[0][0].shape[-2])
        if self.rows == 0:
            self.length = 0
            self.start = []
        if self.layers[0].k_buf is None:
            for layer, (k, v) in zip(self.layers, per_layer):
                shape = (max(self.fixed_rows, 1), k.shape[1], MIN_SLOTS, k.shape[3])
                layer.k_buf = torch.zeros(shape, dtype=k.dtype, device=k.device)
                layer.v_buf = torch.zeros(shape, dtype=v.dtype, device=v.device)
            self.row_capacity, self.slot_capacity = max(self.fixed_rows, 1), MIN_SLOTS
        shift = max(p - self.length, 0)
        self._ensure(self.rows + 1, self.length + shift + 1, shift)
        if shift:
            self.start = [s + shift for s in self.start]
            self.length += shift
        new_row = self.rows
        lo = self.length - p
        for layer, (k, v) in zip(self.layers, per_layer):
            layer.k_buf[new_row, :, :lo].zero_()
            layer.v_buf[new_row, :, :lo].zero_()
            layer.k_buf[new_row, :, lo : self.length] = k[0]
            layer.v_buf[new_row, :, lo : self.length] = v[0]
        self.start.append(lo)
        self.rows += 1
        return new_row

    def remove(self, row: int) -> int | None:
        """Drop ``row``; the last row moves into its place.  Returns the moved row's old
        index (now ``row``), or None when nothing moved."""
        last = self.rows - 1
        moved = None
        if row != last:
            for layer in self.layers:
                layer.k_buf[row, :, : self.length] = layer.k_buf[last, :, : self.length]
                layer.v_buf[row, :, : self.length] = layer.v_buf[last, :, : self.length]
            self.start[row] = self.start[last]
            moved = last
        self.start.pop()
        self.rows -= 1
        if self.rows == 0:
            self.length = 0
        else:
            self._trim()
        return moved

    def _trim(self) -> None:
        m = min(self.start)
        if m < TRIM_MIN_SLOTS or 4 * m < self.length:
            return
        n, keep = self.rows, self.length - m
        for layer in self.layers:
            for buf in (layer.k_buf, layer.v_buf):
                buf[:n, :, :keep] = buf[:n, :, m : self.length].clone()
        self.start = [s - m for s in self.start]
        self.length = keep

    def advance(self, q: int = 1) -> None:
        """The forward that just ran wrote ``q`` slots for every row."""
        self.length += q

    # ------------------------------------------------------------------ step inputs

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``position_ids`` (rows, 1) and the 2-D padding mask (rows, length+1) of the next
        one-token step; the mask is None when no row has padding."""
        pos = torch.tensor([[self.length - s] for s in self.start], dtype=torch.long, device=self.device)
        if not any(self.start):
            return pos, None
        starts = torch.tensor(self.start, dtype=torch.long, device=self.device)
        mask = torch.arange(self.length + 1, device=self.device).unsqueeze(0) >= starts.unsqueeze(1)
        return pos, mask.long()

    def fixed_step_inputs(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fixed-shape one-token step (module doc): the rows it runs (the running rows
        padded to a power of two, at most the capacity), their ``position_ids`` (bucket, 1),
        the 2-D mask (bucket, slot capacity: each row's slots from its start to the step's)
        and the slot written, as ``cache_position``."""
        bucket = 1
        while bucket < self.rows:
            bucket *= 2
        bucket = min(bucket, self.row_capacity)
        # a padding row sees its own slot only
        starts = self.start + [self.length] * (bucket - self.rows)
        start = torch.tensor(starts, dtype=torch.long, device=self.device)
        pos = (self.length - start).unsqueeze(1)
        slots = torch.arange(self.slot_capacity, device=self.device).unsqueeze(0)
        # the slots past this step are masked here too: a mask with nothing masked lets
        # transformers drop it for a one-token query (and attend to every slot)
        mask = (slots >= start.unsqueeze(1)) & (slots <= self.length)
        slot = torch.tensor([self.length], dtype=torch.long, device=self.device)
        return bucket, pos, mask.long(), slot

    def nbytes(self) -> int:
        return sum(
            b.numel() * b.element_size() for layer in self.layers for b in (layer.k_buf, layer.v_buf) if b is not None
        )


__all__ = ["BatchKVCache"]
