"""A request in a mixed continuous batch behaves exactly as it does alone (float32).

Every request of one batch — different steering, some unsteered, different prompt
lengths (one longer than Gemma 2's sliding window), joining at different steps, one
seeded sampler, one cancelled midway — must produce the tokens it produces alone (on the
same batching engine and on the serial engine), monitored activations equal to the solo
run's within the declared tolerance, and a per-request ``steering_apply_count`` equal to
its forward passes when steered (none when not).  One request is also checked against an
independent reference: HF ``generate`` with the test's own steering hook, and a float64
encode of the residual captured in that run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from gpu_engine.api.protocol import (
    GenerationJob,
    GenerationResult,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)
from tests.engine.helpers import RefSAE, add_delta, capture
from tests.engine.tolerances import (
    BATCH_ENCODE_ATOL,
    BATCH_ENCODE_RTOL,
    ENCODE_ATOL,
    ENCODE_RTOL,
    HOOK_ATOL,
    HOOK_RTOL,
    POSITIVE_CONTROL_MIN,
)

from .conftest import MODEL_SAE, Choreography

SHORT = "the cat sat on the mat and"
LONG = "the cat sat on the mat and the dog ran over the hills " * 10  # > 128 tokens (Gemma 2's window)
MEDIUM = "a quick brown fox jumps over the lazy dog while the sun"
TINY = "hello"
# two prompts of nearly the same length, admitted together: one left-padded prefill
PAIR = ("the dog ran over the hills and the cat sat on the mat", "one two three four five six seven eight nine ten")
FEATURES = [0, 7, 100]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def steer(sae, features: dict[int, float] | None) -> SteeringSpec | None:
    if features is None:
        return None
    return SteeringSpec.from_mapping({(sae.name, sae.layer): features})


def monitor(sae, read_point: str, positions: str) -> MonitorSpec:
    return MonitorSpec(
        [MonitorEntry(sae.name, sae.layer, top_k=5, features=FEATURES, read_point=read_point, positions=positions)]
    )


def scenario(sae) -> dict[str, GenerationJob]:
    return {
        # steered and monitored (post-steering, every row), first in
        "A": GenerationJob(
            "A",
            prompt=SHORT,
            sampling=greedy(40),
            steering=steer(sae, {3: 8.0, 17: -5.0}),
            monitor=monitor(sae, "post_steering", "all"),
        ),
        # unsteered, a long prompt that joins later (the batch cache shifts right for it)
        "B": GenerationJob("B", prompt=LONG, sampling=greedy(30), monitor=monitor(sae, "pre_steering", "completion")),
        # other steering, medium prompt
        "C": GenerationJob("C", prompt=MEDIUM, sampling=greedy(25), steering=steer(sae, {40: -6.0, 41: 4.0})),
        # explicitly unsteered (empty feature map), a one-word prompt
        "D": GenerationJob("D", prompt=TINY, sampling=greedy(20), steering=steer(sae, {})),
        # steered, long max_tokens, cancelled midway
        "E": GenerationJob("E", prompt=MEDIUM + " and", sampling=greedy(200), steering=steer(sae, {3: -4.0})),
        # seeded sampling with penalties, steered
        "F": GenerationJob(
            "F",
            prompt=SHORT + " then",
            steering=steer(sae, {17: 6.0}),
            sampling=SamplingParams(
                max_tokens=20,
                temperature=1.1,
                top_p=0.9,
                top_k=40,
                seed=1234,
                repetition_penalty=1.1,
                presence_penalty=0.3,
                frequency_penalty=0.2,
                ignore_eos=True,
            ),
        ),
        # joining together and prefilled in one padded forward: steered + monitored prompt rows,
        # and unsteered + monitored pre-steering
        "G": GenerationJob(
            "G",
            prompt=PAIR[0],
            sampling=greedy(18),
            steering=steer(sae, {5: 7.0}),
            monitor=monitor(sae, "post_steering", "prompt"),
        ),
        "H": GenerationJob("H", prompt=PAIR[1], sampling=greedy(22), monitor=monitor(sae, "pre_steering", "all")),
    }


def assert_same_records(got, want) -> None:
    assert [(r.read_point, r.position, r.token_index) for r in got] == [
        (r.read_point, r.position, r.token_index) for r in want
    ]
    assert got, "the monitor recorded nothing"
    for g, w in zip(got, want):
        assert [f.feature_index for f in g.features] == [f.feature_index for f in w.features] == FEATURES
        np.testing.assert_allclose(
            [f.activation for f in g.features],
            [f.activation for f in w.features],
            atol=BATCH_ENCODE_ATOL,
            rtol=BATCH_ENCODE_RTOL,
        )
        assert [f.feature_index for f in g.top_k] == [f.feature_index for f in w.top_k]
        np.testing.assert_allclose(
            [f.activation for f in g.top_k],
            [f.activation for f in w.top_k],
            atol=BATCH_ENCODE_ATOL,
            rtol=BATCH_ENCODE_RTOL,
        )


def counts(result: GenerationResult) -> list[tuple[str, int, int]]:
    return [(c.sae_id, c.layer, c.count) for c in result.steering_apply_count]


def run_mixed_batch(batched, jobs: dict[str, GenerationJob]) -> tuple[dict[str, GenerationResult], Choreography]:
    choreo = Choreography(batched.backend.model)
    streams = {}

    def submit(name: str) -> None:
        streams[name] = batched.generate(jobs[name])

    choreo.on(3, lambda: submit("B"))
    choreo.on(6, lambda: submit("C"))
    choreo.on(6, lambda: submit("D"))
    choreo.on(10, lambda: submit("F"))
    choreo.on(12, lambda: submit("G"))
    choreo.on(12, lambda: submit("H"))
    choreo.on(15, lambda: streams["E"].cancel())
    with choreo.installed():
        submit("A")
        submit("E")
        deadline = time.monotonic() + 60
        while len(streams) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.005)
        results = {name: streams[name].result(timeout_s=60) for name in jobs}
    return results, choreo


@pytest.mark.parametrize("model_name", list(MODEL_SAE))
def test_every_request_in_a_mixed_batch_equals_its_solo_run(engines, tiny_assets, model_name):
    batched, serial = engines(model_name)
    sae = tiny_assets.saes[MODEL_SAE[model_name]]
    jobs = scenario(sae)
    if model_name == "tiny-gemma2":
        assert len(batched.backend.encode_text(LONG)) > batched.backend.model.config.sliding_window

    before = batched.batching_status()
    mixed, choreo = run_mixed_batch(batched, jobs)
    after = batched.batching_status()
    batch_sizes = choreo.batch_sizes
    solo = {name: batched.generate_sync(job, timeout_s=60) for name, job in jobs.items() if name != "E"}
    # which step ran: the Llama model's every decode step without model.forward (lean.py),
    # the others' through it (the next test holds the Llama batch to HF generate)
    steps, lean = (after[k] - before[k] for k in ("decode_steps", "lean_decode_steps"))
    assert steps > 0 and lean == (steps if model_name == "tiny-llama" else 0)
    serial_runs = {name: serial.generate_sync(job, timeout_s=60) for name, job in jobs.items() if name != "E"}

    # they really shared forward passes (up to seven requests in one step), and G and H
    # were prefilled together in one left-padded forward
    assert max(batch_sizes) >= 6
    assert len(batch_sizes) < sum(r.forward_passes for r in mixed.values())
    assert (2, max(len(batched.backend.encode_text(p)) for p in PAIR)) in choreo.shapes

    for name, res in mixed.items():
        if name == "E":
            continue
        assert res.token_ids == solo[name].token_ids == serial_runs[name].token_ids, name
        assert res.text == solo[name].text and res.finish_reason == solo[name].finish_reason == "length"
        assert res.forward_passes == solo[name].forward_passes == len(res.token_ids)
        steered = jobs[name].steering is not None and not jobs[name].steering.is_empty()
        assert counts(res) == ([(sae.name, sae.layer, res.forward_passes)] if steered else []), name
        assert counts(res) == counts(solo[name])
    for name in ("A", "B", "G", "H"):
        assert_same_records(mixed[name].activations, solo[name].activations)
        assert_same_records(mixed[name].activations, serial_runs[name].activations)

    # the cancelled request stopped within a step of its cancel and kept a solo prefix
    e = mixed["E"]
    e_solo = batched.generate_sync(jobs["E"], timeout_s=60)
    assert e.finish_reason == "cancelled"
    assert 0 < len(e.token_ids) < 30
    assert e.token_ids == e_solo.token_ids[: len(e.token_ids)]
    assert counts(e) == [(sae.name, sae.layer, e.forward_passes)] and e.forward_passes == len(e.token_ids)

    # positive controls: the steers change tokens, so equality above is not vacuous
    for name in ("A", "C", "F"):
        plain = GenerationJob(f"{name}-plain", prompt=jobs[name].prompt, sampling=jobs[name].sampling)
        assert batched.generate_sync(plain, timeout_s=60).token_ids != mixed[name].token_ids, name


def test_a_batched_request_matches_hf_generate_with_the_tests_own_hook(engines, tiny_assets):
    """Independent reference: HF greedy ``generate`` with a hand-made steering hook, and a
    float64 encode of the residual it produces (nothing from the engine's SAE code)."""
    batched, _ = engines("tiny-llama")
    model_asset = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes[MODEL_SAE["tiny-llama"]]
    jobs = scenario(sae)
    mixed, choreo = run_mixed_batch(batched, jobs)
    assert max(choreo.batch_sizes) >= 6
    a = mixed["A"]

    model = batched.backend.model
    module = model.get_submodule(model_asset.layer_module_path(sae.layer))
    ref_sae = RefSAE(sae)
    ids = batched.backend.encode_text(SHORT)
    with torch.inference_mode(), add_delta(module, ref_sae.delta({3: 8.0, 17: -5.0})), capture(module) as post:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            pad_token_id=batched.backend.tokenizer.pad_token_id,
        )
    assert a.token_ids == out[0, len(ids) :].tolist()
    # residual rows in sequence order: the prefill's rows, then one row per decode step
    rows = np.concatenate(post, axis=0)[: len(ids) + len(a.token_ids) - 1]
    ref_acts = ref_sae.encode(rows)
    assert [r.position for r in a.activations] == list(range(len(rows)))
    fired = 0
    for rec in a.activations:
        np.testing.assert_allclose(
            [f.activation for f in rec.features], ref_acts[rec.position][FEATURES], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )
        got = np.array([f.activation for f in rec.top_k])
        np.testing.assert_allclose(
            got, ref_acts[rec.position][[f.feature_index for f in rec.top_k]], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )
        want = np.sort(ref_acts[rec.position][ref_acts[rec.position] > 0])[::-1][:5]
        np.testing.assert_allclose(np.sort(got)[::-1], want, atol=ENCODE_ATOL, rtol=ENCODE_RTOL)
        fired += len(rec.top_k)
    assert fired > 0


def test_each_row_gets_its_own_requests_delta(engines, tiny_assets):
    """In every batched decode forward, a steered row moves by exactly its request's delta
    and an unsteered row does not move at all."""
    batched, _ = engines("tiny-llama")
    model_asset = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes[MODEL_SAE["tiny-llama"]]
    ref = RefSAE(sae)
    f1, f2 = {3: 8.0, 17: -5.0}, {40: -6.0}
    module = batched.backend.model.get_submodule(model_asset.layer_module_path(sae.layer))
    seen_raw: list[np.ndarray] = []
    seen_post: list[np.ndarray] = []

    def grab(store):  # type: ignore[no-untyped-def]
        def hook(mod, args, output):  # type: ignore[no-untyped-def]
            h = output[0] if isinstance(output, tuple) else output
            store.append(h.detach().double().numpy().copy())

        return hook

    h_raw = module.register_forward_hook(grab(seen_raw), prepend=True)
    h_post = module.register_forward_hook(grab(seen_post))
    try:
        streams = [
            batched.generate(GenerationJob("s1", prompt=SHORT, sampling=greedy(12), steering=steer(sae, f1))),
            batched.generate(GenerationJob("u", prompt=MEDIUM, sampling=greedy(12))),
            batched.generate(GenerationJob("s2", prompt=TINY, sampling=greedy(12), steering=steer(sae, f2))),
        ]
        for s in streams:
            s.result(timeout_s=60)
    finally:
        h_raw.remove()
        h_post.remove()
    deltas = [ref.delta(f1), ref.delta(f2)]
    batched_steps = 0
    for raw, post in zip(seen_raw, seen_post):
        if raw.shape[1] != 1 or raw.shape[0] < 2:
            continue  # a prefill (one request alone)
        batched_steps += 1
        moved = 0
        for r in range(raw.shape[0]):
            diff = post[r, 0] - raw[r, 0]
            if np.abs(diff).max() == 0.0:
                continue  # the unsteered row: bit-for-bit untouched
            match = [d for d in deltas if np.allclose(post[r, 0], raw[r, 0] + d, atol=HOOK_ATOL, rtol=HOOK_RTOL)]
            assert len(match) == 1, f"row {r} moved by something that is not its request's delta"
            assert np.abs(diff).max() > POSITIVE_CONTROL_MIN
            moved += 1
        assert moved == raw.shape[0] - 1 if raw.shape[0] == 3 else moved >= 1
    assert batched_steps >= 5
