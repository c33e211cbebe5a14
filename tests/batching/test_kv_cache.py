"""The slab KV cache's bookkeeping: rows land right-aligned on a common slot counter, longer
prompts shift the batch, removals swap the last row in, dead left padding is trimmed."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from gpu_engine.backends.transformers.kv_cache import TRIM_MIN_SLOTS, BatchKVCache

LAYERS, HEADS, DIM = 2, 3, 4


def prefill(tag: int, length: int) -> DynamicCache:
    """A batch-1 cache whose key at position p is ``tag*1000 + p`` (values: negated)."""
    cache = DynamicCache()
    for layer in range(LAYERS):
        k = (tag * 1000 + torch.arange(length, dtype=torch.float32) + 100 * layer).view(1, 1, length, 1)
        k = k.expand(1, HEADS, length, DIM).contiguous()
        cache.update(k, -k, layer)
    return cache


def row_tokens(cache: BatchKVCache, row: int, layer: int = 0) -> list[int]:
    k = cache.layers[layer].k_buf[row, 0, cache.start[row] : cache.length, 0]
    return [int(x) - 100 * layer for x in k.tolist()]


def test_merge_shift_remove_and_trim():
    cache = BatchKVCache(LAYERS, device=torch.device("cpu"), dtype=torch.float32)
    cache.merge(prefill(1, 5))
    assert (cache.rows, cache.length, cache.start) == (1, 5, [0])
    cache.merge(prefill(2, 3))  # shorter: left-padded by 2
    assert cache.start == [0, 2]
    cache.merge(prefill(3, 9))  # longer: every row shifts right by 4
    assert (cache.length, cache.start) == (9, [4, 6, 0])
    for layer in range(LAYERS):
        assert row_tokens(cache, 0, layer) == [1000 + p for p in range(5)]
        assert row_tokens(cache, 1, layer) == [2000 + p for p in range(3)]
        assert row_tokens(cache, 2, layer) == [3000 + p for p in range(9)]
        # padding is zero, values mirror keys
        assert cache.layers[layer].k_buf[0, :, :4].abs().sum() == 0
        assert torch.equal(cache.layers[layer].v_buf[2, :, :9], -cache.layers[layer].k_buf[2, :, :9])

    pos, mask = cache.step_inputs()
    assert pos.view(-1).tolist() == [5, 3, 9]
    assert mask.tolist() == [[0] * 4 + [1] * 6, [0] * 6 + [1] * 4, [1] * 10]

    # a decode step writes slot `length` for every row
    cache.reserve(1)
    step = torch.full((3, HEADS, 1, DIM), 7.0)
    for layer in range(LAYERS):
        k, _ = cache.layers[layer].update(step, step)
        assert k.shape == (3, HEADS, 10, DIM)
    cache.advance(1)
    assert row_tokens(cache, 1)[-1] == 7

    assert cache.remove(0) == 2  # the last row moved into row 0
    assert cache.start == [0, 6] and row_tokens(cache, 0)[:9] == [3000 + p for p in range(9)]
    assert cache.remove(0) == 1
    assert cache.start == [6]  # 6 dead slots: below the trim threshold, kept
    cache.remove(0)
    assert (cache.rows, cache.length) == (0, 0)


def test_dead_left_padding_is_trimmed():
    cache = BatchKVCache(LAYERS, device=torch.device("cpu"), dtype=torch.float32)
    long = TRIM_MIN_SLOTS * 3
    cache.merge(prefill(1, long))
    cache.merge(prefill(2, 4))
    assert cache.start == [0, long - 4]
    cache.remove(0)
    assert (cache.length, cache.start) == (4, [0])
    assert row_tokens(cache, 0) == [2000 + p for p in range(4)]
