"""Every steering mode per request inside one continuous batch: each request equals its
solo run (float32, greedy), on the batching engine and on the serial engine, with its own
per-mode counts and conditional-fire positions."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gpu_engine.api.protocol import (
    FeatureControl,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)

from .conftest import MODEL_SAE, Choreography

PROMPTS = [
    "the cat sat on the mat and",
    "a quick brown fox jumps over the lazy dog while the sun",
    "hello",
    "one two three four five six seven eight nine ten",
    "the dog ran over the hills and the cat sat on the mat",
    "it was a dark and stormy night",
]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def jobs_for(sae, trigger: int, threshold: float, phase_prompt_len: int) -> dict[str, GenerationJob]:
    def spec(features=None, controls=()):
        return SteeringSpec([SteeringEntry(sae.name, sae.layer, features or {}, list(controls))])

    return {
        "clamp": GenerationJob(
            "clamp",
            prompt=PROMPTS[0],
            sampling=greedy(16),
            steering=spec(
                controls=[FeatureControl(3, mode="clamp", value=9.0), FeatureControl(17, mode="clamp", value=0.0)]
            ),
        ),
        "scale": GenerationJob(
            "scale",
            prompt=PROMPTS[1],
            sampling=greedy(14),
            steering=spec(controls=[FeatureControl(trigger, mode="scale", value=60.0)]),
        ),
        "plain": GenerationJob("plain", prompt=PROMPTS[2], sampling=greedy(12), steering=spec({40: -6.0})),
        "ablate": GenerationJob(
            "ablate",
            prompt=PROMPTS[3],
            sampling=greedy(15),
            steering=spec({5: 4.0}, [FeatureControl(40, mode="ablate")]),
            monitor=MonitorSpec([MonitorEntry(sae.name, sae.layer, features=[40], positions="all")]),
        ),
        "phase": GenerationJob(
            "phase",
            prompt=PROMPTS[4],
            sampling=greedy(13),
            steering=spec(
                controls=[
                    FeatureControl(3, value=12.0, phase="completion", window=PositionRange(0, phase_prompt_len + 6))
                ]
            ),
        ),
        "cond": GenerationJob(
            "cond",
            prompt=PROMPTS[5],
            sampling=greedy(12),
            steering=spec(
                controls=[FeatureControl(7, mode="clamp", value=15.0, condition=SteeringCondition(trigger, threshold))]
            ),
        ),
        "none": GenerationJob("none", prompt=PROMPTS[0] + " then", sampling=greedy(10)),
    }


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2"])
def test_a_mixed_batch_of_every_mode_equals_each_solo_run(engines, tiny_assets, model_name):
    batched, serial = engines(model_name)
    sae = tiny_assets.saes[MODEL_SAE[model_name]]
    # a trigger that fires at some rows of the conditional prompt and not others, found
    # from the unsteered residual (the hook's input at the SAE's layer)
    probe = serial.generate_sync(
        GenerationJob(
            "p",
            prompt=PROMPTS[5],
            sampling=greedy(1),
            monitor=MonitorSpec(
                [MonitorEntry(sae.name, sae.layer, top_k=8, read_point="pre_steering", positions="prompt")]
            ),
        )
    )
    counts: dict[int, list[float]] = {}
    for rec in probe.activations:
        for f in rec.top_k:
            counts.setdefault(f.feature_index, []).append(f.activation)
    trigger = max(counts, key=lambda i: (0 < len(counts[i]) < len(probe.activations), len(counts[i])))
    # halfway between two observed values: no row sits on the threshold, where float
    # rounding (batched or solo) could decide
    values = sorted(set(counts[trigger]))
    threshold = (values[0] + values[1]) / 2 if len(values) > 1 else values[0] / 2
    jobs = jobs_for(sae, trigger, threshold, len(batched.backend.encode_text(PROMPTS[4])))

    choreo = Choreography(batched.backend.model)
    streams = {}
    order = list(jobs)
    with choreo.installed():
        for name in order[:3]:
            streams[name] = batched.generate(jobs[name])
        for name, at in zip(order[3:], (3, 5, 5, 8)):
            choreo.on(at, lambda name=name: streams.__setitem__(name, batched.generate(jobs[name])))
        deadline = time.monotonic() + 60
        while len(streams) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.005)
        mixed = {name: streams[name].result(timeout_s=60) for name in jobs}
    assert max(choreo.batch_sizes) >= 5  # they really shared forward passes

    for name, job in jobs.items():
        solo = batched.generate_sync(job, timeout_s=60)
        alone = serial.generate_sync(job, timeout_s=60)
        got = mixed[name]
        assert got.token_ids == solo.token_ids == alone.token_ids, name
        assert got.forward_passes == len(got.token_ids)
        assert [(c.count, c.modes) for c in got.steering_apply_count] == [
            (c.count, c.modes) for c in alone.steering_apply_count
        ], name
        assert [(f.index, f.positions) for f in got.steering_fired] == [
            (f.index, f.positions) for f in alone.steering_fired
        ], name
        for g, w in zip(got.activations, alone.activations):
            assert g.position == w.position
            np.testing.assert_allclose(
                [f.activation for f in g.features], [f.activation for f in w.features], atol=1e-4, rtol=1e-4
            )
        if job.steering is not None:
            modes = {c.mode for e in job.steering.entries for c in e.controls} | (
                {"add"} if any(e.features for e in job.steering.entries) else set()
            )
            assert got.steering_apply_count[0].modes == dict.fromkeys(modes, got.forward_passes), name
            # positive control: the steering changed the request's tokens
            plain = GenerationJob(f"{name}-plain", prompt=job.prompt, sampling=job.sampling)
            assert serial.generate_sync(plain, timeout_s=60).token_ids != got.token_ids, name
        else:
            assert got.steering_apply_count == []

    # the conditional request fired at some rows, not all, in both runs
    (fired,) = mixed["cond"].steering_fired
    rows = mixed["cond"].usage.prompt_tokens + len(mixed["cond"].token_ids) - 1
    assert 0 < len(fired.positions) < rows
    # the monitored request's records are its solo run's (checked above) and cover its rows
    assert len(mixed["ablate"].activations) == mixed["ablate"].usage.prompt_tokens + 14
