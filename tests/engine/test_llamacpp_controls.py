"""Feature controls (clamp, scale, ablate, phases, windows, conditions) on the llama.cpp
backend, against the transformers backend on the same float32 weights.

The tiny Llama checkpoint and its GGUF copy hold the same numbers, and the transformers
backend (checked against independent math in test_steering_modes.py and
test_vectors.py) is the oracle: every request of a mixed, concurrent batch on llama.cpp
— each with its own controls, one unsteered, one only monitored — gives the transformers
backend's greedy tokens, monitored activations, per-mode apply counts and fired
positions, and so does each request run alone on llama.cpp's serial path.  In the
``control_vector_swap`` mode the same requests are refused before anything runs, naming
the field, the backend and the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
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
from gpu_engine.interp.hooks import BatchContext, RequestHooks, Segment
from gpu_engine.runtime.engine import Engine

from .test_llamacpp import ENCODE_ATOL, LOGPROB_ATOL, assert_same_generation, gguf_job
from .test_llamacpp_swap import mixed_run

SWAP = "control_vector_swap"
PROMPTS = [
    "the cat sat on the mat and",
    "a quick brown fox jumps over the lazy dog while the sun",
    "it was a dark and stormy night",
    "one two three four five six seven eight nine ten",
    "the dog ran over the hills and the cat sat on the mat",
    "rain falls on the quiet town",
    "red green blue yellow",
    "hello there my old friend",
]
L1, L3 = "tiny-llama-L1-relu", "tiny-llama-L3-relu"  # layer 3: the model's last layer


def greedy(rid: str, text: str, n: int, *, steering=None, monitor=None) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=text,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5),
    )


@pytest.fixture(scope="module")
def gguf_serial(tiny_gguf):
    eng = Engine()
    eng.load_model(gguf_job(tiny_gguf))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def gguf_batched(tiny_gguf):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=10))
    eng.load_model(gguf_job(tiny_gguf))
    yield eng
    eng.shutdown()


@pytest.fixture
def engines(engine, gguf_serial, gguf_batched, tiny_assets):
    """(transformers, llama.cpp serial, llama.cpp batched), each with the layer-1 and the
    last layer's SAE attached, in the same order."""
    every = (engine, gguf_serial, gguf_batched)
    for eng in every:
        eng.detach(None)
        for name in (L1, L3):
            a = tiny_assets.saes[name]
            eng.attach(AttachSpec(a.name, str(a.path), a.layer))
    yield every
    for eng in every:
        eng.detach(None)


def trigger_for(engine, sae, text: str) -> tuple[int, float]:
    """A feature of ``sae`` that fires at some of ``text``'s prompt rows and not others
    (read on the transformers backend, unsteered), and a threshold halfway between two of
    its values, so no row sits on it where float rounding could decide."""
    probe = engine.generate_sync(
        GenerationJob(
            "probe",
            prompt=text,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            monitor=MonitorSpec(
                [MonitorEntry(sae.name, sae.layer, top_k=8, read_point="pre_steering", positions="prompt")]
            ),
        )
    )
    seen: dict[int, list[float]] = {}
    for rec in probe.activations:
        for f in rec.top_k:
            seen.setdefault(f.feature_index, []).append(f.activation)
    rows = len(probe.activations)
    trigger = max(seen, key=lambda i: (0 < len(seen[i]) < rows, len(seen[i])))
    values = sorted(set(seen[trigger]))
    return trigger, ((values[0] + values[1]) / 2 if len(values) > 1 else values[0] / 2)


def jobs_for(engine, tiny_assets) -> list[GenerationJob]:
    l1, l3 = tiny_assets.saes[L1], tiny_assets.saes[L3]

    def at(sae, features=None, controls=()):
        return SteeringSpec([SteeringEntry(sae.name, sae.layer, features or {}, list(controls))])

    trig1, thr1 = trigger_for(engine, l1, PROMPTS[5])
    trig3, thr3 = trigger_for(engine, l3, PROMPTS[6])
    p4 = len(engine.backend.encode_text(PROMPTS[4]))
    monitor = MonitorSpec(
        [
            MonitorEntry(l1.name, 1, top_k=4, features=[3, 40], positions="all", read_point=rp)
            for rp in ("pre_steering", "post_steering")
        ]
    )
    return [
        # the first four run from the start (long), the rest join while they decode
        greedy(
            "clamp",
            PROMPTS[0],
            24,
            steering=at(l1, controls=[FeatureControl(3, mode="clamp", value=9.0), FeatureControl(17, mode="clamp")]),
        ),
        greedy("scale", PROMPTS[1], 24, steering=at(l1, controls=[FeatureControl(trig1, mode="scale", value=60.0)])),
        greedy("none", PROMPTS[0] + " then", 24),
        greedy(
            "ablate",
            PROMPTS[3],
            24,
            steering=at(l1, {5: 4.0}, [FeatureControl(40, mode="ablate")]),
            monitor=monitor,
        ),
        greedy("phase", PROMPTS[4], 13, steering=at(l1, controls=[FeatureControl(3, value=12.0, phase="completion")])),
        greedy(
            "window",
            PROMPTS[2],
            12,
            steering=at(l1, controls=[FeatureControl(3, value=12.0, window=PositionRange(2, p4 + 4))]),
        ),
        greedy(
            "cond",
            PROMPTS[5],
            12,
            steering=at(l1, controls=[FeatureControl(7, value=15.0, condition=SteeringCondition(trig1, thr1))]),
        ),
        greedy(
            "last",
            PROMPTS[6],
            12,
            steering=at(
                l3,
                controls=[
                    FeatureControl(5, mode="clamp", value=8.0),
                    FeatureControl(9, value=6.0, condition=SteeringCondition(trig3, thr3)),
                ],
            ),
        ),
        greedy("monitored", PROMPTS[7], 12, monitor=monitor),
    ]


def counts(result) -> list[tuple]:
    return [(c.sae_id, c.layer, c.count, c.modes) for c in result.steering_apply_count]


def fired(result) -> list[tuple]:
    return [(f.sae_id, f.layer, f.index, f.mode, f.positions) for f in result.steering_fired]


def assert_same_records(got, want) -> None:
    assert [(r.read_point, r.position) for r in got.activations] == [
        (r.read_point, r.position) for r in want.activations
    ]
    for g, w in zip(got.activations, want.activations):
        np.testing.assert_allclose(
            [f.activation for f in g.features], [f.activation for f in w.features], atol=ENCODE_ATOL
        )
        assert [f.feature_index for f in g.top_k] == [f.feature_index for f in w.top_k]
        np.testing.assert_allclose([f.activation for f in g.top_k], [f.activation for f in w.top_k], atol=ENCODE_ATOL)


def test_a_mixed_batch_of_every_control_equals_the_transformers_backend(engines, tiny_assets, monkeypatch):
    hf, gs, gb = engines
    for eng in (gs, gb):
        caps = eng.status().batching["capabilities"]
        assert caps["steering_mode"] == "eval_callback_per_row" and caps["steering_controls"] is True
    jobs = jobs_for(hf, tiny_assets)
    want = [hf.generate_sync(j) for j in jobs]

    from gpu_engine.backends.llamacpp.batched import LlamaBatchRunner

    shared: list[int] = []  # requests per llama_decode of the batch
    real = LlamaBatchRunner._forward

    def forward(self, parts, tokens):
        shared.append(len(parts))
        return real(self, parts, tokens)

    monkeypatch.setattr(LlamaBatchRunner, "_forward", forward)
    before = dict(gb.backend.steering_forwards)
    mixed = mixed_run(gb, jobs, first=4)
    monkeypatch.undo()
    assert max(shared) >= 6  # they really shared forward passes
    assert gb.backend.steering_forwards["eval_callback"] > before["eval_callback"]
    assert gb.backend.steering_forwards["control_vector"] == before["control_vector"]
    solo = [gs.generate_sync(j) for j in jobs]  # llama.cpp's serial path

    plain = {j.request_id: hf.generate_sync(greedy("p", j.prompt, j.sampling.max_tokens)) for j in jobs}
    for job, got, alone, ref in zip(jobs, mixed, solo, want):
        name = job.request_id
        for run in (got, alone):
            assert_same_generation(run, ref, atol=LOGPROB_ATOL)
            assert counts(run) == counts(ref), name
            assert fired(run) == fired(ref), name
            assert_same_records(run, ref)
        if job.steering is not None:
            modes = {c.mode for e in job.steering.entries for c in e.controls} | (
                {"add"} if any(e.features for e in job.steering.entries) else set()
            )
            assert got.steering_apply_count[0].modes == dict.fromkeys(modes, got.forward_passes), name
            # positive control: the controls changed the request's tokens
            assert plain[name].token_ids != ref.token_ids, name
        else:
            assert got.steering_apply_count == [], name
    by = {j.request_id: r for j, r in zip(jobs, mixed)}
    # the conditional controls fired at some rows, not all
    for name in ("cond", "last"):
        (gate,) = by[name].steering_fired
        rows = by[name].usage.prompt_tokens + len(by[name].token_ids) - 1
        assert 0 < len(gate.positions) < rows, name
    # the monitored requests cover their rows, before and after the steering
    assert len(by["ablate"].activations) == 2 * (by["ablate"].usage.prompt_tokens + 23)
    pre = [f.activation for r in by["ablate"].activations if r.read_point == "pre_steering" for f in r.features]
    post = [f.activation for r in by["ablate"].activations if r.read_point == "post_steering" for f in r.features]
    assert max(abs(a - b) for a, b in zip(pre, post)) > 1e-3  # the two reads differ


@pytest.fixture(scope="module")
def vector_file(tmp_path_factory, tiny_assets):
    d = tiny_assets.models["tiny-llama"].hidden_size
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("vec") / "direction.safetensors"
    save_file({"layer.1": (3.0 * rng.normal(size=d)).astype(np.float32)}, str(path), metadata={"model_name": "x"})
    return path


def test_raw_vectors_take_the_modes_transformers_allows(engine, gguf_serial, gguf_batched, vector_file):
    """add and ablate on a raw vector run as on transformers (serial and in a batch beside
    a plain request); clamp, scale and conditions read an activation a vector has none of,
    refused naming the field as on transformers."""
    every = (engine, gguf_serial, gguf_batched)
    for eng in every:
        eng.detach(None)
        eng.attach(AttachSpec("vec", str(vector_file), 1, layout="vector"))
    try:
        late = SteeringSpec([SteeringEntry("vec", 1, controls=[FeatureControl(0, value=1.5, phase="completion")])])
        ablate = SteeringSpec([SteeringEntry("vec", 1, controls=[FeatureControl(0, mode="ablate")])])
        jobs = [greedy("late", PROMPTS[0], 10, steering=late), greedy("ablate", PROMPTS[3], 10, steering=ablate)]
        want = [engine.generate_sync(j) for j in jobs]
        plain = [engine.generate_sync(greedy("plain", j.prompt, 10)) for j in jobs]
        for w, p in zip(want, plain):
            assert p.token_ids != w.token_ids  # positive control: the control does something
        mixed = mixed_run(gguf_batched, [*jobs, greedy("plain", PROMPTS[3], 10)], first=3)
        for got, ref in zip([*(gguf_serial.generate_sync(j) for j in jobs), *mixed[:2]], [*want, *want]):
            assert_same_generation(got, ref)
            assert counts(got) == counts(ref)
        assert_same_generation(mixed[2], plain[1])
        for control, param in [
            (FeatureControl(0, mode="clamp", value=2.0), "steering.features.mode"),
            (FeatureControl(0, mode="scale", value=2.0), "steering.features.mode"),
            (FeatureControl(0, value=2.0, condition=SteeringCondition(0, 0.1)), "steering.features.condition"),
        ]:
            for eng in every:
                with pytest.raises(InvalidParameter) as exc:
                    eng.generate_sync(
                        greedy("r", PROMPTS[0], 2, steering=SteeringSpec([SteeringEntry("vec", 1, controls=[control])]))
                    )
                assert exc.value.details["param"] == param
                assert "raw steering vector" in exc.value.message
    finally:
        for eng in every:
            eng.detach(None)


@pytest.fixture(scope="module", params=["serial", "batched"])
def swap_engine(request, tiny_gguf):
    batching = BatchingOptions(enabled=True, max_batch_size=4) if request.param == "batched" else None
    eng = Engine(batching=batching) if batching else Engine()
    eng.load_model(gguf_job(tiny_gguf, steering_mode=SWAP))
    yield eng
    eng.shutdown()


def test_the_swap_mode_refuses_controls_naming_field_backend_and_reason(swap_engine, tiny_assets, monkeypatch):
    """A control vector adds one vector to every row: controls, which read each row, are
    off in the capabilities with the reason, and a request with one is refused before any
    decode runs (llama.cpp's own ``llama_decode`` is never called), while a plain add on
    the same attachment runs."""
    import llama_cpp.llama_cpp as lc

    sae = tiny_assets.saes[L1]
    swap_engine.detach(None)
    swap_engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    caps = swap_engine.status().batching["capabilities"]
    assert caps["steering_mode"] == SWAP and caps["steering_controls"] is False
    assert SWAP in caps["steering_controls_reason"]
    decodes = []
    real = lc.llama_decode
    monkeypatch.setattr(lc, "llama_decode", lambda ctx, batch: decodes.append(1) or real(ctx, batch))
    for control in (
        FeatureControl(3, mode="clamp", value=2.0),
        FeatureControl(3, mode="ablate"),
        FeatureControl(3, value=2.0, phase="completion"),
    ):
        spec = SteeringSpec([SteeringEntry(sae.name, sae.layer, {}, [control])])
        with pytest.raises(InvalidParameter) as exc:
            swap_engine.generate_sync(greedy("c", PROMPTS[0], 4, steering=spec))
        assert exc.value.details["param"] == "steering.features.mode"
        assert exc.value.details["backend"] == "llamacpp"
        assert SWAP in exc.value.details["reason"] and SWAP in exc.value.message
    assert decodes == []
    key = (sae.name, sae.layer)
    out = swap_engine.generate_sync(greedy("p", PROMPTS[0], 4, steering=SteeringSpec.from_mapping({key: {3: 6.0}})))
    assert out.steering_apply_count[0].count == out.forward_passes and decodes
    # the backend refuses it too when handed the plans directly (its own check, which the
    # serial and the batched path both run)
    from gpu_engine.interp.plans import build_hooks

    entry = SteeringEntry(sae.name, sae.layer, {}, [FeatureControl(3, mode="clamp", value=2.0)])
    saes = {key: swap_engine._attachments[key].sae}
    hooks = build_hooks(saes, "d", [entry], [], n_prompt=3, dtype=torch.float32, device="cpu")
    with pytest.raises(InvalidParameter) as exc:
        swap_engine.backend._check_steering(hooks)
    assert exc.value.details["param"] == "steering.features.mode" and SWAP in exc.value.details["reason"]
    swap_engine.detach(None)


def test_a_context_window_and_selection_renumber_rows_slots_positions_and_segments():
    """What the eval callback hands ``route`` for a ubatch (``window``) and for the last
    layer's output rows (``select``), against a hand computation."""
    a, b = RequestHooks("a"), RequestHooks("b")
    # rows 0-3: request a at positions 10-13; rows 4-7: request b at positions 0-3
    ctx = BatchContext(
        [Segment(a, 0, 4, 10), Segment(b, 4, 8, 0)],
        row_slots=torch.tensor([2, 2, 2, 2, 5, 5, 5, 5]),
        row_positions=torch.tensor([10, 11, 12, 13, 0, 1, 2, 3]),
    )
    w = ctx.window(3, 6)
    assert w.row_slots.tolist() == [2, 5, 5] and w.row_positions.tolist() == [13, 0, 1]
    assert [(s.request.request_id, s.row_start, s.row_end, s.start_position) for s in w.segments] == [
        ("a", 0, 1, 13),
        ("b", 1, 3, 0),
    ]
    assert w.applied is ctx.applied and w.delta_tables is ctx.delta_tables
    assert ctx.window(0, 8) is ctx
    s = ctx.select([3, 5, 6, 7])  # a's last row; b's rows from position 1
    assert s.row_slots.tolist() == [2, 5, 5, 5] and s.row_positions.tolist() == [13, 1, 2, 3]
    assert [(g.request.request_id, g.row_start, g.row_end, g.start_position) for g in s.segments] == [
        ("a", 0, 1, 13),
        ("b", 1, 4, 1),
    ]
    gap = ctx.select([0, 2, 3])  # not consecutive: one segment per run of positions
    assert [(g.row_start, g.row_end, g.start_position) for g in gap.segments] == [(0, 1, 10), (1, 3, 12)]
    assert ctx.select(list(range(8))) is ctx
