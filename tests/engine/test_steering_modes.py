"""Steering modes, phases, windows and conditions (docs/steering.md, "Modes"), each checked
at every position against the formula computed here in float64 from the SAE's files and
the residual the hook received (nothing from the engine's SAE code)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.errors import InvalidFeatureIndex, InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    FeatureControl,
    GenerationJob,
    PositionRange,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)

from .helpers import RefSAE, block, capture
from .tolerances import HOOK_ATOL, HOOK_RTOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"
N_TOKENS = 6


def job(
    request_id: str,
    controls: list[FeatureControl],
    sae,
    features: dict[int, float] | None = None,
    max_tokens: int = N_TOKENS,
) -> GenerationJob:
    spec = SteeringSpec([SteeringEntry(sae.name, sae.layer, features or {}, controls)])
    return GenerationJob(
        request_id,
        prompt=PROMPT,
        steering=spec,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def run(engine, model, sae, controls, features=None):
    """(result, raw rows, post rows): the block's output before and after the engine's hook,
    in sequence order (prefill rows, then one row per decode step)."""
    module = block(engine, model, sae.layer)
    with capture(module, before_engine=True) as raw, capture(module) as post:
        out = engine.generate_sync(job("m", controls, sae, features))
    return out, np.concatenate(raw, axis=0), np.concatenate(post, axis=0)


@pytest.fixture
def attached(engine, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    return engine, model, sae, RefSAE(sae)


def busiest_feature(ref: RefSAE, rows: np.ndarray, skip: int | None = None) -> int:
    """The feature active at the most rows (ties: the larger mean activation)."""
    acts = ref.encode(rows)
    score = (acts > 0).sum(axis=0) * 1e6 + acts.mean(axis=0)
    if skip is not None:
        score[skip] = -1
    return int(np.argmax(score))


def unsteered_rows(engine, model, sae) -> np.ndarray:
    with capture(block(engine, model, sae.layer)) as rows:
        engine.generate_sync(GenerationJob("u", prompt=PROMPT, sampling=SamplingParams(max_tokens=2, temperature=0.0)))
    return rows[0]


def assert_rows(post: np.ndarray, want: np.ndarray, moved: np.ndarray) -> None:
    np.testing.assert_allclose(post, want, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    # positive control: the rows meant to move really moved
    assert moved.any()


def test_clamp_sets_the_feature_and_leaves_a_row_already_there_unchanged(attached):
    engine, model, sae, ref = attached
    f = busiest_feature(ref, unsteered_rows(engine, model, sae))
    out, raw, post = run(engine, model, sae, [FeatureControl(f, mode="clamp", value=5.0)])
    a = ref.encode(raw)[:, f]
    want = raw + (5.0 - a)[:, None] * ref.W_dec[f]
    assert_rows(post, want, np.abs(post - raw).max(axis=-1) > POSITIVE_CONTROL_MIN)
    assert len(post) == out.usage.prompt_tokens + N_TOKENS - 1
    # clamping to what a row already holds changes nothing there
    out2, raw2, post2 = run(engine, model, sae, [FeatureControl(f, mode="clamp", value=float(a[0]))])
    np.testing.assert_allclose(post2[0], raw2[0], atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert [(c.count, c.modes) for c in out.steering_apply_count] == [(N_TOKENS, {"clamp": N_TOKENS})]


def test_scale_multiplies_the_features_activation(attached):
    engine, model, sae, ref = attached
    f = busiest_feature(ref, unsteered_rows(engine, model, sae))
    out, raw, post = run(engine, model, sae, [FeatureControl(f, mode="scale", value=3.0)])
    a = ref.encode(raw)[:, f]
    assert (a > 0).any()
    want = raw + (2.0 * a)[:, None] * ref.W_dec[f]
    assert_rows(post, want, a > 0)
    # rows where the feature is silent are untouched: scale reads the row, it adds nothing fixed
    np.testing.assert_array_equal(post[a == 0], raw[a == 0])


def test_ablate_removes_the_direction(attached):
    engine, model, sae, ref = attached
    out, raw, post = run(engine, model, sae, [FeatureControl(3, mode="ablate")])
    d = ref.W_dec[3] / np.linalg.norm(ref.W_dec[3])
    want = raw - (raw @ d)[:, None] * d
    assert_rows(post, want, np.abs(raw @ d) > POSITIVE_CONTROL_MIN)
    np.testing.assert_allclose(post @ d, 0.0, atol=1e-4)


def test_phase_and_window_choose_the_positions(attached):
    engine, model, sae, ref = attached
    delta = ref.W_dec[3] * 8.0
    out, raw, post = run(engine, model, sae, [FeatureControl(3, mode="add", value=8.0, phase="completion")])
    p = out.usage.prompt_tokens
    np.testing.assert_array_equal(post[:p], raw[:p])  # the prompt rows are not steered
    assert_rows(post[p:], raw[p:] + delta, np.ones(1, bool))

    out, raw, post = run(engine, model, sae, [FeatureControl(3, mode="add", value=8.0, phase="prompt")])
    assert_rows(post[:p], raw[:p] + delta, np.ones(1, bool))
    np.testing.assert_array_equal(post[p:], raw[p:])

    out, raw, post = run(engine, model, sae, [FeatureControl(3, value=8.0, window=PositionRange(2, p + 2))])
    inside = np.zeros(len(raw), bool)
    inside[2 : p + 2] = True
    want = raw + inside[:, None] * delta
    assert_rows(post, want, inside)
    np.testing.assert_array_equal(post[~inside], raw[~inside])
    # a window and a phase intersect
    out, raw, post = run(
        engine, model, sae, [FeatureControl(3, value=8.0, phase="completion", window=PositionRange(0, p + 2))]
    )
    inside = np.zeros(len(raw), bool)
    inside[p : p + 2] = True
    np.testing.assert_allclose(post, raw + inside[:, None] * delta, atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_conditional_steering_fires_only_where_the_trigger_does_and_says_where(attached):
    engine, model, sae, ref = attached
    rows = unsteered_rows(engine, model, sae)
    trigger = busiest_feature(ref, rows)
    target = busiest_feature(ref, rows, skip=trigger)
    acts = ref.encode(rows)[:, trigger]
    threshold = float(np.median(acts[acts > 0])) if (acts > 0).sum() > 1 else 0.0
    control = FeatureControl(target, mode="clamp", value=6.0, condition=SteeringCondition(trigger, threshold))
    out, raw, post = run(engine, model, sae, [control], features={7: 2.0})
    enc = ref.encode(raw)
    fires = enc[:, trigger] > threshold
    assert fires.any() and not fires.all()  # the condition really splits the rows
    want = raw + 2.0 * ref.W_dec[7] + (fires * (6.0 - enc[:, target]))[:, None] * ref.W_dec[target]
    np.testing.assert_allclose(post, want, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    (fired,) = out.steering_fired
    assert (fired.sae_id, fired.layer, fired.index, fired.mode) == (sae.name, sae.layer, target, "clamp")
    assert fired.positions == [int(i) for i in np.flatnonzero(fires)]
    assert [(c.count, c.modes) for c in out.steering_apply_count] == [(N_TOKENS, {"add": N_TOKENS, "clamp": N_TOKENS})]


def test_modes_compose_from_the_same_residual(attached):
    engine, model, sae, ref = attached
    controls = [
        FeatureControl(3, mode="clamp", value=4.0),
        FeatureControl(40, mode="ablate"),
        FeatureControl(17, mode="scale", value=0.0),
    ]
    out, raw, post = run(engine, model, sae, controls, features={5: -3.0})
    enc = ref.encode(raw)
    d = ref.W_dec[40] / np.linalg.norm(ref.W_dec[40])
    want = (
        raw
        - 3.0 * ref.W_dec[5]
        + (4.0 - enc[:, 3])[:, None] * ref.W_dec[3]
        - (raw @ d)[:, None] * d
        - enc[:, 17][:, None] * ref.W_dec[17]
    )
    np.testing.assert_allclose(post, want, atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_bad_controls_are_refused_naming_the_field_before_anything_runs(attached):
    engine, model, sae, ref = attached
    with pytest.raises(InvalidParameter) as exc:
        FeatureControl(3, mode="boost", value=1.0)
    assert exc.value.details["param"] == "steering.features.mode"
    with pytest.raises(InvalidParameter) as exc:
        FeatureControl(3, value=1.0, phase="decode")
    assert exc.value.details["param"] == "steering.features.phase"
    with pytest.raises(InvalidParameter) as exc:
        FeatureControl(3, mode="ablate", value=2.0)
    assert exc.value.details["param"] == "steering.features.value"
    with pytest.raises(InvalidParameter):
        SteeringEntry(sae.name, sae.layer, {3: 1.0}, [FeatureControl(3, mode="clamp", value=1.0)])
    with pytest.raises(InvalidFeatureIndex):
        engine.generate_sync(
            job("t", [FeatureControl(3, mode="clamp", value=1.0, condition=SteeringCondition(sae.d_sae, 0.0))], sae)
        )
    with pytest.raises(InvalidParameter) as exc:
        engine.generate_sync(job("w", [FeatureControl(3, value=1.0, window=PositionRange(100_000, None))], sae))
    assert exc.value.details["param"] == "steering.features.window"
    with pytest.raises(InvalidParameter) as exc:  # a window that ends inside the prompt, completion only
        engine.generate_sync(
            job("e", [FeatureControl(3, value=1.0, phase="completion", window=PositionRange(0, 2))], sae)
        )
    assert exc.value.details["param"] == "steering.features.window"
