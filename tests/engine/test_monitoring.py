"""Monitoring values against an independent float64 SAE encode of the captured residual."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringSpec,
)

from .helpers import RefSAE, block, capture
from .tolerances import ENCODE_ATOL, ENCODE_RTOL

PROMPT = "a quick brown fox jumps over"
TOP_K = 5
REQUESTED = [0, 7, 100, 255]


def job(request_id: str, monitor=None, steering=None, max_tokens: int = 5, **sampling) -> GenerationJob:
    return GenerationJob(
        request_id,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling),
        monitor=monitor,
        steering=steering,
    )


def rows_by_position(captured: list[np.ndarray]) -> np.ndarray:
    """Residual rows of all forwards in sequence order (prefill rows, then one per step)."""
    return np.concatenate(captured, axis=0)


def check_record(rec, ref_acts: np.ndarray) -> None:
    # requested features: exact values (zeros included)
    assert [f.feature_index for f in rec.features] == REQUESTED
    np.testing.assert_allclose(
        [f.activation for f in rec.features], ref_acts[REQUESTED], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
    )
    # top-k: each reported value is that feature's value, and the values are the k largest
    got_idx = [f.feature_index for f in rec.top_k]
    got_val = np.array([f.activation for f in rec.top_k])
    np.testing.assert_allclose(got_val, ref_acts[got_idx], atol=ENCODE_ATOL, rtol=ENCODE_RTOL)
    expected = np.sort(ref_acts[ref_acts > 0])[::-1][:TOP_K]
    np.testing.assert_allclose(np.sort(got_val)[::-1], expected, atol=ENCODE_ATOL, rtol=ENCODE_RTOL)


@pytest.mark.parametrize("sae_name", ["tiny-llama-L1-relu", "tiny-llama-L2-jumprelu", "tiny-llama-L2-topk"])
@pytest.mark.parametrize(
    "read_point, stream", [("pre_steering", False), ("post_steering", False), ("post_steering", True)]
)
def test_monitoring_equals_an_independent_encode(engine, tiny_assets, sae_name, read_point, stream):
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes[sae_name]
    ref = RefSAE(asset)
    engine.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    steering = SteeringSpec.from_mapping({(asset.name, asset.layer): {5: 3.0, 9: -2.0}})
    monitor = MonitorSpec(
        [
            MonitorEntry(
                asset.name,
                asset.layer,
                top_k=TOP_K,
                features=REQUESTED,
                read_point=read_point,
                positions="all",
                stream=stream,
            )
        ]
    )
    module = block(engine, model, asset.layer)
    with capture(module, before_engine=True) as raw, capture(module) as post:
        out = engine.generate_sync(job("m", monitor, steering))
    rows = rows_by_position(raw if read_point == "pre_steering" else post)
    n_prompt = out.usage.prompt_tokens
    assert [r.position for r in out.activations] == list(range(n_prompt + len(out.token_ids) - 1))
    ref_acts = ref.encode(rows)
    fired = 0
    for rec in out.activations:
        assert rec.read_point == read_point
        assert rec.token_index == (rec.position - (n_prompt - 1) if rec.position >= n_prompt - 1 else None)
        check_record(rec, ref_acts[rec.position])
        fired += len(rec.top_k)
    assert fired > 0  # positive control: features do fire on this input
    if asset.activation == "topk":
        assert all(len(r.top_k) <= asset.k for r in out.activations)
    # pre and post differ by the steer, so the two read points must disagree somewhere
    other = ref.encode(rows_by_position(post if read_point == "pre_steering" else raw))
    assert np.abs(other - ref_acts).max() > 1e-2


def test_arming_monitoring_does_not_change_generation(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L2-topk"]
    engine.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    kw = {"max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    plain = engine.generate_sync(job("plain", **kw))
    monitored = engine.generate_sync(
        job("mon", MonitorSpec([MonitorEntry(asset.name, 2, top_k=8, features=[1, 2])]), **kw)
    )
    assert monitored.token_ids == plain.token_ids
    assert [lp.logprob for lp in monitored.logprobs] == [lp.logprob for lp in plain.logprobs]
    assert monitored.activations and not plain.activations


@pytest.mark.parametrize(
    "positions, expected",
    [
        ("prompt", lambda p, n: list(range(p))),
        ("completion", lambda p, n: list(range(p - 1, p - 1 + n))),
        ("last", lambda p, n: [p + n - 2]),
        ("all", lambda p, n: list(range(p + n - 1))),
        (PositionRange(2, 4), lambda p, n: [2, 3]),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
def test_positions_select_residual_rows(engine, tiny_assets, positions, expected, stream):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    spec = MonitorSpec([MonitorEntry(asset.name, 1, features=[3], positions=positions, stream=stream)])
    events = list(engine.generate(job("p", spec, max_tokens=4)))
    tokens = [e for e in events if e.type == "token"]
    finish = events[-1]
    assert finish.type == "finish"
    n_prompt = finish.usage.prompt_tokens
    on_tokens = [r for e in tokens for r in e.activations]
    got = sorted(r.position for r in on_tokens + finish.activations)
    assert got == expected(n_prompt, len(tokens))
    if stream and positions != "last":
        # a completion row's record travels with that token's event
        assert all(r.token_index is None for r in finish.activations)
        for e in tokens:
            assert all(r.token_index == e.index for r in e.activations)
    else:
        assert on_tokens == []


def test_monitor_requests_only_what_it_asks(engine, tiny_assets):
    """Features-only monitoring on a ReLU SAE still matches the reference (selected columns)."""
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    with capture(block(engine, model, 1)) as post:
        out = engine.generate_sync(job("f", MonitorSpec([MonitorEntry(asset.name, 1, features=REQUESTED)])))
    ref_acts = RefSAE(asset).encode(rows_by_position(post))
    for rec in out.activations:
        assert rec.top_k == []
        np.testing.assert_allclose(
            [f.activation for f in rec.features], ref_acts[rec.position][REQUESTED], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )


def test_batched_encode_in_chunks_gives_the_same_records(engine, tiny_assets, monkeypatch):
    from gpu_engine.interp import monitors

    asset = tiny_assets.saes["tiny-llama-L2-topk"]
    engine.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    spec = MonitorSpec([MonitorEntry(asset.name, 2, top_k=TOP_K, features=REQUESTED, positions="all")])
    whole = engine.generate_sync(job("w", spec, max_tokens=6)).activations
    monkeypatch.setattr(monitors, "FLUSH_CHUNK_ROWS", 3)
    chunked = engine.generate_sync(job("c", spec, max_tokens=6)).activations
    assert [r.position for r in chunked] == [r.position for r in whole]
    for a, b in zip(chunked, whole):
        assert [f.feature_index for f in a.top_k] == [f.feature_index for f in b.top_k]
        np.testing.assert_allclose(
            [f.activation for f in a.features], [f.activation for f in b.features], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )


def test_rows_computed_again_are_recorded_once(tiny_assets):
    """A preempted vLLM request is recomputed from position 0 (or from its cached prefix):
    the monitor sees positions it has seen before and must not record them twice."""
    import torch

    from gpu_engine.interp import monitors
    from gpu_engine.sae.layouts import get_layout
    from gpu_engine.sae.module import SAE

    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    lay = get_layout("saelens")
    cfg = lay.read_metadata(lay.detect(asset.path) or asset.path)
    sae = SAE(cfg, lay.load_tensors(cfg), device=torch.device("cpu"))
    rows = torch.randn(12, sae.d_in)
    entry = MonitorEntry(asset.name, 1, top_k=TOP_K, features=REQUESTED, positions="all")
    once, again = (monitors.MonitorPlan(entry, sae, prompt_len=6) for _ in range(2))
    once.observe(rows[:6], 0)
    once.observe(rows[6:9], 6)
    once.observe(rows[9:], 9)
    # the same request preempted after position 8 and recomputed from 0, then from 4
    again.observe(rows[:6], 0)
    again.observe(rows[6:9], 6)
    again.observe(rows[:9], 0)
    again.observe(rows[4:10], 4)
    again.observe(rows[10:], 10)
    want, got = [], []
    for plan, out in ((once, want), (again, got)):
        plan.flush()
        out.extend(plan.collect())
    assert [r.position for r in got] == [r.position for r in want] == list(range(12))
    for a, b in zip(got, want):
        assert [f.activation for f in a.features] == [f.activation for f in b.features]
