"""Tensor-parallel capture shards (issue 15, item 2: "shards merged on read"), without vLLM.

Under tensor parallelism each vLLM rank holds a contiguous run of query heads and the KV
heads they read (one KV head replicated on several ranks when there are fewer KV heads
than ranks).  The head ranges below are worked out by hand from that rule; the parts a
rank would send are slices of full arrays made here, and ``load_capture`` must rebuild
exactly the asked heads of the full arrays from the packed shards (numpy and torch).
The vLLM backend's real TP=2 run is ``tests/vllm/test_vllm_capture.py``'s opt-in test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save

from gpu_engine.api.artifacts import load_capture
from gpu_engine.interp.capture import AttentionGeometry, CapturePart, CapturePlan, HeadShard, for_shard
from gpu_engine.api.protocol import AttentionCaptureSpec, CaptureSpec

# (num_heads, num_kv_heads, ranks) -> per rank (head_start, heads, kv_start, kv_heads), by hand
SHARDS = {
    (8, 4, 2): [(0, 4, 0, 2), (4, 4, 2, 2)],
    (8, 2, 4): [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)],  # KV replicated twice
    (2, 1, 2): [(0, 1, 0, 1), (1, 1, 0, 1)],  # tiny-llama at TP=2
}


@pytest.mark.parametrize("shape", list(SHARDS))
def test_head_shards_follow_the_tensor_parallel_split(shape):
    heads, kv, size = shape
    got = [HeadShard.of(r, size, num_heads=heads, num_kv_heads=kv, head_dim=16) for r in range(size)]
    assert [(s.head_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in got] == SHARDS[shape]
    group = heads // kv
    for s in got:  # every query head a rank holds reads a KV head the same rank holds
        assert all(
            s.kv_start <= h // group < s.kv_start + s.num_kv_heads
            for h in range(s.head_start, s.head_start + s.num_heads)
        )


def test_for_shard_gives_each_rank_its_own_heads_and_rank_zero_the_hidden_states():
    spec = CaptureSpec(layers=[1], positions="all", attention=AttentionCaptureSpec(layers=[0, 2], heads=[1, 2, 5, 6]))
    shards = [HeadShard.of(r, 4, num_heads=8, num_kv_heads=2, head_dim=16) for r in range(4)]
    got = [for_shard(spec, s, hidden=s.rank == 0) for s in shards]
    assert [(g[1], g[2]) for g in got] == [([1], [0]), ([2], [0]), ([5], [1]), ([6], [1])]
    local = [g[0] for g in got]
    assert local[0].layers == [1] and all(s.layers == [] for s in local[1:])
    assert [s.attention.heads for s in local] == [[1], [0], [1], [0]]  # renumbered within each rank
    assert all(s.attention.layers == [0, 2] for s in local)
    # a rank holding none of the asked heads and no hidden layer takes nothing
    only = CaptureSpec(attention=AttentionCaptureSpec(layers=[0], heads=[7]))
    assert for_shard(only, shards[0], hidden=True) == (None, [], [])
    # a pipeline stage takes only the layers it holds
    assert for_shard(spec, shards[0], hidden=True, held={2})[0].attention.layers == [2]


def _part(
    rank: int,
    q: dict[int, np.ndarray],
    k: dict[int, np.ndarray],
    heads,
    kv_heads,
    rows: int,
    hidden: dict[int, np.ndarray] | None = None,
) -> CapturePart:
    tensors = {f"q.{layer}": torch.from_numpy(v.copy()) for layer, v in q.items()}
    tensors.update({f"k.{layer}": torch.from_numpy(v.copy()) for layer, v in k.items()})
    tensors["q_positions"], tensors["k_positions"] = torch.arange(rows), torch.arange(rows)
    if hidden:
        tensors.update({f"layer.{layer}": torch.from_numpy(v.copy()) for layer, v in hidden.items()})
        tensors["positions"] = torch.arange(rows, dtype=torch.int64)
    return CapturePart(rank, save({n: t.contiguous() for n, t in tensors.items()}), tuple(heads), tuple(kv_heads))


def _driver_plan(spec: CaptureSpec, geometry: AttentionGeometry, prompt: int) -> CapturePlan:
    return CapturePlan(
        spec,
        request_id="r",
        prompt_len=prompt,
        max_tokens=3,
        hidden_size=8,
        dtype=torch.float32,
        device=None,
        model="m",
        backend="vllm",
        steering_hash=None,
        geometry=geometry,
    )


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_shards_are_merged_on_read_into_the_asked_heads(framework):
    rng = np.random.default_rng(0)
    rows, d = 5, 16
    full_q = {layer: rng.standard_normal((rows, 8, d)).astype(np.float32) for layer in (0, 2)}
    full_k = {layer: rng.standard_normal((rows, 2, d)).astype(np.float32) for layer in (0, 2)}
    hidden = {1: rng.standard_normal((rows, 8)).astype(np.float32)}
    heads = [1, 2, 5, 6]
    spec = CaptureSpec(
        layers=[1], positions="all", attention=AttentionCaptureSpec(layers=[0, 2], heads=heads, positions="all")
    )
    # what ranks 0..3 of TP=4 hold of those heads (SHARDS[(8, 2, 4)]): one query head each
    ranks = [(0, [1], [0]), (1, [2], [0]), (2, [5], [1]), (3, [6], [1])]
    parts = [
        _part(
            r,
            {L: full_q[L][:, h] for L in (0, 2)},
            {L: full_k[L][:, kv] for L in (0, 2)},
            h,
            kv,
            rows,
            hidden if r == 0 else None,
        )
        for r, h, kv in ranks
    ]
    plan = _driver_plan(spec, AttentionGeometry(8, 2, d), prompt=3)
    plan.receive(parts[::-1])  # ranks report in any order
    result = plan.result(prompt_ids=[5, 6, 7], generated=[8, 9, 10])
    cap = load_capture(result.data, framework=framework)
    assert cap.attention["shards"] == [{"rank": r, "heads": h, "kv_heads": kv} for r, h, kv in ranks]
    assert cap.attention["heads"] == heads and cap.attention["kv_heads"] == [0, 1]
    for layer in (0, 2):
        q, k = np.asarray(cap.q[layer]), np.asarray(cap.k[layer])
        assert np.array_equal(q, full_q[layer][:, heads])
        assert np.array_equal(k, full_k[layer][:, [0, 1]])
    assert np.array_equal(np.asarray(cap.hidden[1]), hidden[1])
    assert np.asarray(cap.token_ids).tolist() == [5, 6, 7, 8, 9]
    assert np.asarray(cap.q_positions).tolist() == list(range(rows))


def test_one_rank_holding_every_asked_head_writes_plain_tensors_and_a_missing_shard_fails():
    rng = np.random.default_rng(1)
    q = {0: rng.standard_normal((2, 1, 4)).astype(np.float32)}
    k = {0: rng.standard_normal((2, 1, 4)).astype(np.float32)}
    spec = CaptureSpec(attention=AttentionCaptureSpec(layers=[0], heads=[3], positions="all"))
    plan = _driver_plan(spec, AttentionGeometry(4, 2, 4), prompt=1)
    plan.receive([_part(1, q, k, [3], [1], 2)])
    cap = load_capture(plan.result(prompt_ids=[1], generated=[2, 3]).data)
    assert "shards" not in cap.attention and np.array_equal(cap.q[0], q[0]) and np.array_equal(cap.k[0], k[0])
    # two ranks, one shard lost: refused on read, never a silently partial merge
    spec = CaptureSpec(attention=AttentionCaptureSpec(layers=[0], positions="all"))
    plan = _driver_plan(spec, AttentionGeometry(2, 1, 4), prompt=1)
    plan.receive([_part(0, q, k, [0], [0], 2), _part(1, q, k, [1], [0], 2)])
    data = plan.result(prompt_ids=[1], generated=[2, 3]).data
    assert load_capture(data).q[0].shape == (2, 2, 4)
    from safetensors.torch import load as load_bytes

    from gpu_engine.api.artifacts import SIDECAR_KEY, _header_metadata

    tensors = load_bytes(data)
    del tensors["q.0.tp1"]
    broken = save(tensors, metadata=_header_metadata(data))
    assert SIDECAR_KEY in _header_metadata(broken)
    with pytest.raises(ValueError, match="q.0.tp1"):
        load_capture(broken)


def test_a_request_no_worker_ran_gets_empty_tensors_of_the_right_shape():
    spec = CaptureSpec(layers=[0, 2], attention=AttentionCaptureSpec(layers=[1], heads=[0, 3]))
    plan = _driver_plan(spec, AttentionGeometry(4, 2, 4), prompt=2)
    cap = load_capture(plan.result(prompt_ids=[1, 2], generated=[]).data)
    assert {layer: v.shape for layer, v in cap.hidden.items()} == {0: (0, 8), 2: (0, 8)}
    assert cap.q[1].shape == (0, 2, 4) and cap.k[1].shape == (0, 2, 4)
    assert cap.positions.tolist() == [] and cap.meta["rows"] == 0
