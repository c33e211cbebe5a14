"""A vector's clamp (``SteeringVector(mode="clamp")``, docs/steering.md "Inline vectors"):
each row's projection ``c = x · u`` on the vector's unit direction held within
``[min, max]`` and blended by ``strength``: ``x + strength · (clip(c) − c) · u``. Checked
against the test's own float64 formula on the residual the engine's hook received, and
against a run with no steering where the test's own forward hook applies the formula:
the greedy tokens and the block outputs agree; a clamp of 0 at strength 1 is the ablation
of the same direction."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from gpu_engine.api.protocol import AttachSpec, GenerationJob, SamplingParams, SteeringEntry, SteeringSpec
from gpu_engine.api.steering import FeatureControl, SteeringVector

from .helpers import RefSAE, _hidden, block, capture
from .tolerances import HOOK_ATOL, HOOK_RTOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"


@pytest.fixture
def attached(engine, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    return engine, model, sae, RefSAE(sae)


def _job(sae, vectors=(), features=None, controls=(), max_tokens=8) -> GenerationJob:
    spec = SteeringSpec([SteeringEntry(sae.name, sae.layer, features or {}, list(controls), list(vectors))])
    return GenerationJob(
        "c",
        prompt=PROMPT,
        steering=spec,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _run(engine, model, sae, **kw):
    module = block(engine, model, sae.layer)
    with capture(module, before_engine=True) as raw, capture(module) as post:
        out = engine.generate_sync(_job(sae, **kw))
    return out, np.concatenate(raw, axis=0), np.concatenate(post, axis=0)


def _direction(width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(width).astype(np.float32)


def _clamp(x: np.ndarray, v: np.ndarray, lo: float, hi: float, strength: float) -> np.ndarray:
    """The fork's formula in float64, row by row."""
    u = v.astype(np.float64) / np.linalg.norm(v.astype(np.float64))
    c = x @ u
    return x + strength * (np.clip(c, lo, hi) - c)[:, None] * u


@contextlib.contextmanager
def _own_clamp(module: torch.nn.Module, v: np.ndarray, lo: float, hi: float, strength: float):
    """The test's own hook: the block's output clamped in float64, cast back."""

    def hook(mod, args, output):
        h = _hidden(output)
        x = h.detach().double().cpu().numpy()
        y = _clamp(x.reshape(-1, x.shape[-1]), v, lo, hi, strength).reshape(x.shape)
        new = torch.from_numpy(y).to(dtype=h.dtype, device=h.device)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _projections(engine, model, sae, v: np.ndarray) -> np.ndarray:
    _, raw, _ = _run(engine, model, sae)
    return raw @ (v.astype(np.float64) / np.linalg.norm(v.astype(np.float64)))


def test_a_clamp_holds_each_rows_projection_within_its_bounds(attached):
    engine, model, sae, ref = attached
    v = _direction(ref.W_dec.shape[1])
    c = _projections(engine, model, sae, v)
    lo, hi = float(np.quantile(c, 0.1)), float(np.quantile(c, 0.2))
    vector = SteeringVector(v.tobytes(), "float32", 0.75, mode="clamp", min=lo, max=hi)
    out, raw, post = _run(engine, model, sae, vectors=[vector])
    np.testing.assert_allclose(post, _clamp(raw, v, lo, hi, 0.75), atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert np.abs(post - raw).max() > POSITIVE_CONTROL_MIN  # the bounds cut through the rows
    # one-sided: only rows above max move
    vector = SteeringVector(v.tobytes(), "float32", 1.0, mode="clamp", max=hi)
    out, raw, post = _run(engine, model, sae, vectors=[vector])
    np.testing.assert_allclose(post, _clamp(raw, v, -np.inf, hi, 1.0), atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert out.steering_apply_count[0].count == out.forward_passes


def test_tokens_and_states_match_the_tests_own_clamp_hook(attached):
    engine, model, sae, ref = attached
    v = _direction(ref.W_dec.shape[1], seed=3)
    c = _projections(engine, model, sae, v)
    value = float(np.abs(c).max() * 6 + 5)  # far outside the rows' projections: moves the answer
    vector = SteeringVector(v.tobytes(), "float32", 1.0, mode="clamp", min=value, max=value)
    got, _, post = _run(engine, model, sae, vectors=[vector])
    module = block(engine, model, sae.layer)
    with _own_clamp(module, v, value, value, 1.0), capture(module) as own:
        want = engine.generate_sync(_job(sae))  # nothing steered by the engine
    plain = engine.generate_sync(_job(sae))
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(post, np.concatenate(own, axis=0), atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert got.token_ids != plain.token_ids  # positive control: the clamp changes the answer


def test_phases_choose_the_rows(attached):
    engine, model, sae, ref = attached
    v = _direction(ref.W_dec.shape[1], seed=4)
    for phase in ("prompt", "completion"):
        vector = SteeringVector(v.tobytes(), "float32", 1.0, phase, mode="clamp", min=0.0, max=0.0)
        out, raw, post = _run(engine, model, sae, vectors=[vector])
        p = out.usage.prompt_tokens
        steered, kept = (slice(0, p), slice(p, None)) if phase == "prompt" else (slice(p, None), slice(0, p))
        np.testing.assert_array_equal(post[kept], raw[kept])
        np.testing.assert_allclose(post[steered], _clamp(raw[steered], v, 0, 0, 1.0), atol=HOOK_ATOL, rtol=HOOK_RTOL)
        assert np.abs(post[steered] - raw[steered]).max() > POSITIVE_CONTROL_MIN


def test_clamps_apply_in_order_after_the_attachments_adds(attached):
    engine, model, sae, ref = attached
    width = ref.W_dec.shape[1]
    v1, v2 = _direction(width, seed=5), _direction(width, seed=6)
    v2 = v2 + 2 * v1  # not orthogonal: the order matters
    add = _direction(width, seed=7) * 0.5
    vectors = [
        SteeringVector(add.tobytes(), "float32", 2.0),  # a plain add at every row
        SteeringVector(v1.tobytes(), "float32", 1.0, mode="clamp", min=1.0, max=1.0),
        SteeringVector(v2.tobytes(), "float32", 0.5, mode="clamp", max=-1.0),
    ]
    out, raw, post = _run(engine, model, sae, vectors=vectors, features={3: 1.5})
    x = raw + 2.0 * add.astype(np.float64) + ref.delta({3: 1.5})
    want = _clamp(_clamp(x, v1, 1.0, 1.0, 1.0), v2, -np.inf, -1.0, 0.5)
    np.testing.assert_allclose(post, want, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    # positive controls: the other order, and both clamps reading the same row, are other results
    other = _clamp(_clamp(x, v2, -np.inf, -1.0, 0.5), v1, 1.0, 1.0, 1.0)
    together = _clamp(x, v1, 1.0, 1.0, 1.0) + _clamp(x, v2, -np.inf, -1.0, 0.5) - x
    for alternative in (other, together):
        assert not np.allclose(post, alternative, atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_a_clamp_to_zero_is_the_ablation_of_the_direction(attached):
    engine, model, sae, ref = attached
    index = 5
    v = (3.0 * ref.W_dec[index]).astype(np.float32)  # the feature's direction, another length
    clamp = SteeringVector(v.tobytes(), "float32", 1.0, mode="clamp", min=0.0, max=0.0)
    as_clamp, raw, post = _run(engine, model, sae, vectors=[clamp])
    as_ablate, _, post_ablate = _run(engine, model, sae, controls=[FeatureControl(index, mode="ablate")])
    assert as_clamp.token_ids == as_ablate.token_ids
    np.testing.assert_allclose(post, post_ablate, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert np.abs(post - raw).max() > POSITIVE_CONTROL_MIN


def test_a_clamp_changes_the_steering_hash_and_sorts_its_bounds_into_it():
    data = _direction(8).tobytes()
    a = SteeringSpec([SteeringEntry("s", 1, {}, [], [SteeringVector(data, mode="clamp", min=0.0, max=1.0)])])
    b = SteeringSpec([SteeringEntry("s", 1, {}, [], [SteeringVector(data, mode="clamp", min=0.0, max=2.0)])])
    add = SteeringSpec([SteeringEntry("s", 1, {}, [], [SteeringVector(data)])])
    assert len({a.canonical_hash(), b.canonical_hash(), add.canonical_hash()}) == 3
    assert a.canonical_text().endswith("\tmode=clamp\tmin=0000000000000000\tmax=3ff0000000000000\n")
    assert a.has_controls() and not add.has_controls()


def test_a_clamp_keys_the_prompts_kv_unless_it_is_gated_to_the_completion():
    from gpu_engine.decode.prefix_cache import UNSTEERED, steering_key

    data = _direction(8).tobytes()

    def key(phase):
        vector = SteeringVector(data, "float32", 1.0, phase, mode="clamp", max=0.0)
        return steering_key(SteeringSpec([SteeringEntry("s", 1, {}, [], [vector])]), 5)

    assert key("completion") == UNSTEERED
    assert key("all") != UNSTEERED and key("prompt") != UNSTEERED and key("all") != key("prompt")
