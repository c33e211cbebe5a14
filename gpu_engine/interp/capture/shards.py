"""Capture over tensor-parallel ranks (the vLLM backend's workers): the heads one rank
holds (``HeadShard``), the part of a spec it takes (``for_shard``) and what it drains for
the driver's plan to pack (``CapturePart``)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ...api.protocol import CaptureSpec
from .sizing import AttentionGeometry


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
