"""Scheduler behaviour a caller sees: stops, logprobs, streaming monitors, drains, refusals,
errors that stay with their request, out-of-memory recovery, status."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_engine.api.errors import EngineBusy
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    EmbedJob,
    EngineStatus,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    GenerationResult,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    ScoreJob,
    SteeringSpec,
    TokenEvent,
    from_json,
    to_json,
)
from tests.engine.tolerances import BATCH_ENCODE_ATOL, BATCH_ENCODE_RTOL, BATCH_LOGPROB_ATOL

from .conftest import MODEL_SAE, Choreography, load

PROMPTS = ["the cat sat on the mat and", "a quick brown fox jumps over", "hello", "the sun rises over the hills and"]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture
def llama(engines, tiny_assets):
    batched, serial = engines("tiny-llama")
    sae = tiny_assets.saes[MODEL_SAE["tiny-llama"]]
    return batched, serial, sae


def wait_running(engine, n: int, timeout_s: float = 30.0) -> None:
    """Until ``n`` requests share the batch (reading events here would consume them)."""
    deadline = time.monotonic() + timeout_s
    while engine.status().batching["running"] < n:
        assert time.monotonic() < deadline, "the batch never filled"
        time.sleep(0.002)


def together(engine, jobs: list[GenerationJob]) -> list[GenerationResult]:
    streams = [engine.generate(j) for j in jobs]
    return [s.result(timeout_s=60) for s in streams]


def test_stop_sequences_and_stop_tokens_end_only_their_request(llama):
    batched, serial, _ = llama
    base = serial.generate_sync(GenerationJob("b", prompt=PROMPTS[0], sampling=greedy(30)))
    stop = base.text[len(base.text) // 3 :][:3]
    assert stop.strip()
    stop_id = base.token_ids[4]
    jobs = [
        GenerationJob("s", prompt=PROMPTS[0], sampling=greedy(30, stop=[stop])),
        GenerationJob("t", prompt=PROMPTS[0], sampling=greedy(30, stop_token_ids=[stop_id])),
        GenerationJob("l", prompt=PROMPTS[1], sampling=greedy(30)),
    ]
    streams = [batched.generate(j) for j in jobs]
    events = [list(s) for s in streams]
    results = [GenerationResult.from_events(e) for e in events]
    for job, res in zip(jobs, results):
        alone = serial.generate_sync(job)
        assert (res.token_ids, res.text, res.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert results[0].finish_reason == "stop" and stop not in results[0].text
    assert results[0].text == base.text[: base.text.find(stop)]
    assert results[1].finish_reason == "stop" and results[1].token_ids[-1] == stop_id
    assert results[2].finish_reason == "length" and len(results[2].token_ids) == 30
    # streamed deltas add up to the final text and never leak the stop sequence
    assert "".join(e.text for e in events[0] if isinstance(e, TokenEvent)) == results[0].text


def test_logprobs_in_a_batch_equal_the_solo_run(llama):
    batched, serial, _ = llama
    jobs = [
        GenerationJob(f"l{i}", prompt=p, sampling=greedy(8, logprobs=True, top_logprobs=3, prompt_logprobs=i == 0))
        for i, p in enumerate(PROMPTS)
    ]
    for job, res in zip(jobs, together(batched, jobs)):
        alone = serial.generate_sync(job)
        assert res.token_ids == alone.token_ids
        for got, want in zip(res.logprobs, alone.logprobs):
            assert got.token_id == want.token_id
            np.testing.assert_allclose(got.logprob, want.logprob, atol=BATCH_LOGPROB_ATOL)
            assert [e.token_id for e in got.top_logprobs] == [e.token_id for e in want.top_logprobs]
        if alone.prompt_logprobs is not None:
            np.testing.assert_allclose(res.prompt_logprobs[1:], alone.prompt_logprobs[1:], atol=BATCH_LOGPROB_ATOL)


def test_prompt_alternatives_in_a_batch_equal_the_solo_run(llama):
    """A steered and an unsteered echo request (prompt logprobs + top-3 alternatives) beside
    other rows: each equals its serial run, and the steered one differs (positive control)."""
    batched, serial, sae = llama
    steering = SteeringSpec.from_mapping({(sae.name, sae.layer): {3: 6.0}})
    echo = greedy(4, prompt_logprobs=True, prompt_top_logprobs=3)
    jobs = [
        GenerationJob("e", prompt=PROMPTS[0], sampling=echo, steering=steering),
        GenerationJob("p", prompt=PROMPTS[0], sampling=echo),
        GenerationJob("x", prompt=PROMPTS[1], sampling=greedy(8), steering=steering),
        GenerationJob("y", prompt=PROMPTS[3], sampling=echo),
    ]
    results = together(batched, jobs)
    for job, res in zip(jobs, results):
        alone = serial.generate_sync(job)
        assert res.token_ids == alone.token_ids
        if not job.sampling.prompt_logprobs:
            assert res.prompt_top_logprobs is None
            continue
        np.testing.assert_allclose(res.prompt_logprobs[1:], alone.prompt_logprobs[1:], atol=BATCH_LOGPROB_ATOL)
        assert res.prompt_top_logprobs[0] is None and len(res.prompt_top_logprobs) == len(alone.prompt_top_logprobs)
        for got, want in zip(res.prompt_top_logprobs[1:], alone.prompt_top_logprobs[1:]):
            assert [e.token_id for e in got] == [e.token_id for e in want]
            np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=BATCH_LOGPROB_ATOL)
    steered, plain = results[0], results[1]
    assert np.abs(np.subtract(steered.prompt_logprobs[1:], plain.prompt_logprobs[1:])).max() > 0.05


def test_streaming_monitor_records_travel_with_their_tokens(llama):
    batched, serial, sae = llama
    mon = MonitorSpec([MonitorEntry(sae.name, sae.layer, top_k=4, features=[1, 2], stream=True)])
    steering = SteeringSpec.from_mapping({(sae.name, sae.layer): {3: 5.0}})
    jobs = [
        GenerationJob("m", prompt=PROMPTS[0], sampling=greedy(10), monitor=mon, steering=steering),
        GenerationJob("u", prompt=PROMPTS[1], sampling=greedy(12)),
    ]
    streams = [batched.generate(j) for j in jobs]
    events = list(streams[0])
    streams[1].result(timeout_s=60)
    alone = list(serial.generate(jobs[0]))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    solo_tokens = [e for e in alone if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == [t.token_id for t in solo_tokens]
    for t, s in zip(tokens, solo_tokens):
        assert [r.token_index for r in t.activations] == [r.token_index for r in s.activations] == [t.index]
        for a, b in zip(t.activations, s.activations):
            np.testing.assert_allclose(
                [f.activation for f in a.features],
                [f.activation for f in b.features],
                atol=BATCH_ENCODE_ATOL,
                rtol=BATCH_ENCODE_RTOL,
            )


def test_detach_drains_the_running_batch_and_a_short_wait_is_refused(llama, tiny_assets):
    batched, _, sae = llama
    steering = SteeringSpec.from_mapping({(sae.name, sae.layer): {3: 5.0}})
    jobs = [
        GenerationJob(f"d{i}", prompt=p, sampling=greedy(300), steering=steering) for i, p in enumerate(PROMPTS[:3])
    ]
    streams = [batched.generate(j) for j in jobs]
    wait_running(batched, 3)
    # a wait too short for the batch to drain: refused, nothing changed, the batch goes on
    with pytest.raises(EngineBusy):
        batched.detach(sae.name, timeout_s=0.02)
    assert [a.sae_id for a in batched.attachments()] == [sae.name]
    # a wait long enough: returns once every running request has finished, steered throughout
    assert batched.detach(sae.name, timeout_s=60) == [(sae.name, sae.layer)]
    # every finish event was already delivered when detach returned
    rest = [list(s.events(timeout_s=0.001)) for s in streams]
    assert all(isinstance(r[-1], FinishEvent) for r in rest)
    for r in rest:
        res = GenerationResult.from_events(r)
        assert res.finish_reason == "length" and res.steering_apply_count[0].count == res.forward_passes == 300
    assert batched.hook_manager.installed() == []
    batched.attach(AttachSpec(sae.name, str(sae.path), sae.layer))


def test_embeddings_and_scores_run_between_steps_unsteered(llama):
    batched, serial, sae = llama
    before_e = serial.embed(EmbedJob("e", [PROMPTS[0]])).embeddings
    before_s = serial.score(ScoreJob("s", prompt=PROMPTS[0], top_k=3)).top
    steering = SteeringSpec.from_mapping({(sae.name, sae.layer): {3: 50.0}})
    streams = [
        batched.generate(GenerationJob(f"g{i}", prompt=p, sampling=greedy(400), steering=steering))
        for i, p in enumerate(PROMPTS[:2])
    ]
    wait_running(batched, 2)
    t0 = time.monotonic()
    emb = batched.embed(EmbedJob("e", [PROMPTS[0]]), timeout_s=30).embeddings
    score = batched.score(ScoreJob("s", prompt=PROMPTS[0], top_k=3), timeout_s=30).top
    waited = time.monotonic() - t0
    running = batched.status().batching["running"]
    np.testing.assert_allclose(emb, before_e, atol=1e-5)
    assert [e.token_id for e in score] == [e.token_id for e in before_s]
    assert running == 2, f"embed/score waited for the whole batch ({waited:.2f}s)"
    for s in streams:
        s.cancel()
        s.result(timeout_s=60)


def test_a_bad_request_fails_alone(llama):
    batched, serial, sae = llama
    good = [GenerationJob(f"g{i}", prompt=p, sampling=greedy(12)) for i, p in enumerate(PROMPTS[:2])]
    bad = [
        GenerationJob(
            "x", prompt=PROMPTS[2], sampling=greedy(5), steering=SteeringSpec.from_mapping({("nope", 1): {1: 1.0}})
        ),
        GenerationJob(
            "y",
            prompt=PROMPTS[2],
            sampling=greedy(5),
            steering=SteeringSpec.from_mapping({(sae.name, sae.layer): {10_000: 1.0}}),
        ),
        GenerationJob("z", prompt_token_ids=[1, 10_000], sampling=greedy(5)),
    ]
    streams = [batched.generate(j) for j in good[:1] + bad + good[1:]]
    outcomes = [list(s)[-1] for s in streams]
    assert [o.code for o in outcomes[1:4]] == ["sae_not_attached", "invalid_feature_index", "invalid_parameter"]
    for job, out in zip(good, [outcomes[0], outcomes[4]]):
        assert isinstance(out, FinishEvent) and out.token_ids == serial.generate_sync(job).token_ids


def test_queue_bound_refuses_at_once(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=1, max_queue_size=1))
    try:
        streams = [eng.generate(GenerationJob(f"q{i}", prompt=PROMPTS[0], sampling=greedy(200))) for i in range(3)]
        last = list(streams[2])
        assert isinstance(last[-1], ErrorEvent) and last[-1].code == "engine_busy"
        assert last[-1].details["reason"] == "batch_queue_full"
        assert [len(s.result(timeout_s=60).token_ids) for s in streams[:2]] == [200, 200]
        assert eng.status().batching["refused_total"] == 1
    finally:
        eng.shutdown()


def test_force_serial_monitoring_runs_monitored_requests_alone(tiny_assets):
    sae = tiny_assets.saes[MODEL_SAE["tiny-llama"]]
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, force_serial_monitoring=True))
    try:
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        mon = MonitorSpec([MonitorEntry(sae.name, sae.layer, top_k=3)])
        choreo = Choreography(eng.backend.model)
        with choreo.installed():
            results = together(
                eng,
                [
                    GenerationJob("m", prompt=PROMPTS[0], sampling=greedy(10), monitor=mon),
                    GenerationJob("u1", prompt=PROMPTS[1], sampling=greedy(10)),
                    GenerationJob("u2", prompt=PROMPTS[2], sampling=greedy(10)),
                ],
            )
        n = results[0].forward_passes
        assert choreo.batch_sizes[:n] == [1] * n  # the monitored request ran alone
        assert max(choreo.batch_sizes[n:]) == 2  # the others then shared their steps
    finally:
        eng.shutdown()


def test_out_of_memory_in_a_step_fails_the_batch_detaches_and_keeps_serving(tiny_assets, monkeypatch):
    sae = tiny_assets.saes[MODEL_SAE["tiny-llama"]]
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True))
    try:
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        runner = eng.backend
        calls = {"n": 0}

        def flaky(real):  # type: ignore[no-untyped-def]
            def step(*a, **kw):  # type: ignore[no-untyped-def]
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
                return real(*a, **kw)

            return step

        # the third model step fails, whichever path takes it: model.forward for the
        # prefills, the lean step (lean.py) for the batch's decode steps
        monkeypatch.setattr(runner, "forward_rows", flaky(runner.forward_rows))
        assert runner.lean is not None
        monkeypatch.setattr(runner.lean, "step_rows", flaky(runner.lean.step_rows))
        steering = SteeringSpec.from_mapping({(sae.name, sae.layer): {3: 5.0}})
        streams = [
            eng.generate(GenerationJob(f"o{i}", prompt=p, sampling=greedy(20), steering=steering))
            for i, p in enumerate(PROMPTS[:2])
        ]
        ends = [list(s)[-1] for s in streams]
        assert all(isinstance(e, ErrorEvent) and e.code == "insufficient_memory" for e in ends)
        assert eng.attachments() == [] and eng.hook_manager.installed() == []
        assert any(e.name == "engine:out_of_memory" for e in eng.events)
        after = eng.generate_sync(GenerationJob("after", prompt=PROMPTS[0], sampling=greedy(5)), timeout_s=60)
        assert len(after.token_ids) == 5
    finally:
        eng.shutdown()


def test_status_reports_the_batching_backend(llama, engines):
    batched, serial, _ = llama
    streams = [batched.generate(GenerationJob(f"s{i}", prompt=p, sampling=greedy(200))) for i, p in enumerate(PROMPTS)]
    wait_running(batched, 4)
    status = batched.status()
    b = status.batching
    assert b["mode"] == "continuous_batching" and b["enabled"] is True
    assert b["max_batch_size"] == 8 and b["running"] == 4 and b["waiting"] == 0
    assert b["capabilities"]["per_request_steering"] and b["capabilities"]["exact_monitoring_attribution"]
    assert b["capabilities"]["serial_fallback"] is False
    assert status.in_flight == 4
    assert from_json(to_json(status), EngineStatus) == status
    assert serial.status().batching["mode"] == "serial"
    for s in streams:
        s.cancel()
    for s in streams:
        assert s.result(timeout_s=60).finish_reason == "cancelled"
