"""Steering through the engine's hooks, checked against the test's own arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.protocol import AttachSpec, GenerationJob, SamplingParams, SteeringSpec

from .helpers import (
    RefSAE,
    add_delta,
    assert_prompt_alternatives,
    block,
    capture,
    count_forwards,
    prompt_log_softmax,
)
from .tolerances import HOOK_ATOL, HOOK_RTOL, LOGPROB_ATOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"
FEATURES = {3: 8.0, 17: -5.0}


def greedy(request_id: str, max_tokens: int = 12, steering: SteeringSpec | None = None, **kw) -> GenerationJob:
    return GenerationJob(
        request_id,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        steering=steering,
        **kw,
    )


def steer(sae_name: str, layer: int, features=FEATURES) -> SteeringSpec:
    return SteeringSpec.from_mapping({(sae_name, layer): features})


def attach(engine, asset):
    return engine.attach(AttachSpec(asset.name, str(asset.path), asset.layer))


def test_hooked_output_is_raw_output_plus_delta_at_every_position(engine, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    result = attach(engine, asset)
    assert result.layer_module_path == model.layer_module_path(1) == "model.layers.1"
    delta = RefSAE(asset).delta(FEATURES)
    module = block(engine, model, 1)
    with capture(module, before_engine=True) as raw, capture(module) as post, count_forwards(engine.backend.model) as n:
        out = engine.generate_sync(greedy("s", 6, steer(asset.name, 1)))
    assert n[0] == out.forward_passes == 6 == len(raw) == len(post)
    assert raw[0].shape[0] == out.usage.prompt_tokens  # prefill covers every prompt position
    for r, p in zip(raw, post):
        np.testing.assert_allclose(p, r + delta, atol=HOOK_ATOL, rtol=HOOK_RTOL)
        # positive control: the steer really moved every position
        assert np.abs(p - r).max(axis=-1).min() > POSITIVE_CONTROL_MIN

    # and the raw output is what the model computes without any steering
    with capture(module) as unsteered:
        engine.generate_sync(greedy("u", 1))
    np.testing.assert_allclose(raw[0], unsteered[0], atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_steering_changes_greedy_tokens_and_detach_restores_them_bit_for_bit(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    base = engine.generate_sync(greedy("base"))
    attach(engine, asset)
    idle = engine.generate_sync(greedy("idle"))  # attached, request brings no steering
    steered = engine.generate_sync(greedy("steered", steering=steer(asset.name, 1)))
    assert idle.token_ids == base.token_ids
    assert steered.token_ids != base.token_ids
    engine.detach(asset.name)
    after = engine.generate_sync(greedy("after"))
    assert after.token_ids == base.token_ids
    assert after.text == base.text


def test_engine_steering_matches_a_hand_made_hook(engine, tiny_assets):
    """Same tokens as the test's own forward hook adding the same delta."""
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    base = engine.generate_sync(greedy("base"))
    with add_delta(block(engine, model, 1), RefSAE(asset).delta(FEATURES)):
        reference = engine.generate_sync(greedy("ref"))
    assert reference.token_ids != base.token_ids  # positive control
    attach(engine, asset)
    steered = engine.generate_sync(greedy("steered", steering=steer(asset.name, 1)))
    assert steered.token_ids == reference.token_ids


def test_prompt_logprobs_and_alternatives_are_the_steered_prefills(engine, tiny_assets):
    """Echoed log-likelihoods of a steered request (lm-eval through ``model@profile``): the
    prompt tokens' logprobs and top-k alternatives are the steered forward's, equal to a
    plain forward with the test's own hook adding the delta."""
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    ids = engine.backend.encode_text(PROMPT)
    want = prompt_log_softmax(engine, ids, steer=(block(engine, model, 1), RefSAE(asset).delta(FEATURES)))
    unsteered = prompt_log_softmax(engine, ids)
    assert np.abs(want[:-1] - unsteered[:-1]).max() > POSITIVE_CONTROL_MIN  # the steer moves them
    attach(engine, asset)
    sampling = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True, prompt_top_logprobs=3
    )
    got = engine.generate_sync(
        GenerationJob("s", prompt_token_ids=ids, sampling=sampling, steering=steer(asset.name, 1))
    )
    assert_prompt_alternatives(got, want, ids, 3, LOGPROB_ATOL)
    assert [(c.layer, c.count) for c in got.steering_apply_count] == [(1, 1)]
    plain = engine.generate_sync(GenerationJob("u", prompt_token_ids=ids, sampling=sampling))
    assert_prompt_alternatives(plain, unsteered, ids, 3, LOGPROB_ATOL)
    assert plain.prompt_logprobs != got.prompt_logprobs


def test_steering_apply_count_equals_forward_passes(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    attach(engine, asset)
    with count_forwards(engine.backend.model) as n:
        out = engine.generate_sync(greedy("a", 9, steer(asset.name, 1)))
    assert n[0] == out.forward_passes == 9
    assert [(c.sae_id, c.layer, c.count) for c in out.steering_apply_count] == [(asset.name, 1, 9)]
    with count_forwards(engine.backend.model) as n2:
        engine.generate_sync(greedy("b", 4, steer(asset.name, 1)))
        engine.generate_sync(greedy("unsteered", 5))
    assert n2[0] == 9
    (status,) = engine.attachments()
    assert status.steering_apply_count == 9 + 4  # the unsteered request added nothing


def test_two_saes_on_two_layers_compose(engine, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    a1 = tiny_assets.saes["tiny-llama-L1-relu"]
    a3 = tiny_assets.saes["tiny-llama-L3-relu"]
    f1, f3 = {3: 8.0}, {40: -6.0, 41: 4.0}
    d1, d3 = RefSAE(a1).delta(f1), RefSAE(a3).delta(f3)
    base = engine.generate_sync(greedy("base"))
    with add_delta(block(engine, model, 1), d1), add_delta(block(engine, model, 3), d3):
        reference = engine.generate_sync(greedy("ref"))
    with add_delta(block(engine, model, 1), d1):
        only_first = engine.generate_sync(greedy("ref1"))
    assert reference.token_ids != base.token_ids and reference.token_ids != only_first.token_ids  # controls

    results = engine.attach_set([AttachSpec(a1.name, str(a1.path), 1), AttachSpec(a3.name, str(a3.path), 3)])
    assert [r.layer_module_path for r in results] == ["model.layers.1", "model.layers.3"]
    spec = SteeringSpec.from_mapping({(a1.name, 1): f1, (a3.name, 3): f3})
    with capture(block(engine, model, 3), before_engine=True) as raw3, capture(block(engine, model, 3)) as post3:
        out = engine.generate_sync(greedy("both", steering=spec))
    assert out.token_ids == reference.token_ids
    for r, p in zip(raw3, post3):
        np.testing.assert_allclose(p, r + d3, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert sorted((c.layer, c.count) for c in out.steering_apply_count) == [(1, 12), (3, 12)]


def test_requests_carry_their_own_steering(engine, tiny_assets):
    """Queued steered and unsteered requests do not leak into each other."""
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    base = engine.generate_sync(greedy("base"))
    attach(engine, asset)
    alone = engine.generate_sync(greedy("alone", steering=steer(asset.name, 1)))
    assert alone.token_ids != base.token_ids
    streams = [engine.generate(greedy(f"r{i}", steering=steer(asset.name, 1) if i % 2 else None)) for i in range(4)]
    results = [s.result(timeout_s=60) for s in streams]
    for i, r in enumerate(results):
        assert r.token_ids == (alone.token_ids if i % 2 else base.token_ids)


def test_gemma2_and_gpt2_blocks_are_steered(engine_factory, tiny_assets):
    for model_name, sae_name in (("tiny-gemma2", "tiny-gemma2-L1-jumprelu"), ("tiny-gpt2", "tiny-gpt2-L1-relu")):
        eng = engine_factory(model_name)
        model, asset = tiny_assets.models[model_name], tiny_assets.saes[sae_name]
        res = eng.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
        assert res.layer_module_path == model.layer_module_path(asset.layer)
        module = eng.backend.model.get_submodule(res.layer_module_path)
        delta = RefSAE(asset).delta(FEATURES)
        with capture(module, before_engine=True) as raw, capture(module) as post:
            out = eng.generate_sync(greedy("g", 3, steer(asset.name, asset.layer)))
        assert len(raw) == out.forward_passes == 3
        for r, p in zip(raw, post):
            np.testing.assert_allclose(p, r + delta, atol=HOOK_ATOL, rtol=HOOK_RTOL)
            assert np.abs(p - r).max() > POSITIVE_CONTROL_MIN
        eng.shutdown()


def test_empty_steering_spec_is_unsteered(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    attach(engine, asset)
    base = engine.generate_sync(greedy("base"))
    out = engine.generate_sync(greedy("empty", steering=SteeringSpec.from_mapping({(asset.name, 1): {}})))
    assert out.token_ids == base.token_ids and out.steering_apply_count == []


@pytest.mark.parametrize("strength", [200.5, -201.0])
def test_strength_out_of_range_is_refused(strength):
    from gpu_engine.api.errors import InvalidParameter

    with pytest.raises(InvalidParameter) as err:
        SteeringSpec.from_mapping({("x", 1): {0: strength}})
    assert err.value.param == "steering.features.strength"
