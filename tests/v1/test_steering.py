"""Per-request steering and activations on /v1: inline features, profiles with an
intensity dial, ``model@profile``, what X-miLLM-Steering reports, and the ``millm``
object — each compared with the engine run directly on the same resolved spec."""

from __future__ import annotations

import openai
import pytest

from gpu_engine.api.protocol import (
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from steering.services import profile_create
from tests.v1.conftest import attach
from tests.v1.helpers import assert_openai_error, request

PROMPT = "the sea and the sky"


def _direct(server, steering=None, monitor=None, max_tokens=16):
    return server.engine.generate_sync(
        GenerationJob(
            request_id="ref",
            prompt=PROMPT,
            steering=steering,
            monitor=monitor,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        ),
        timeout_s=60,
    )


def _complete(server, **extra):
    return request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra},
    )


@pytest.fixture
def relu(llama):
    sae = attach("tiny-llama-L1-relu", 1)
    return sae


def test_inline_steering_runs_exactly_the_requested_spec(relu, llama):
    features = [{"index": 3, "strength": 12.0}, {"index": 40, "strength": -6.5}]
    resp = _complete(llama, steering={"features": features})
    assert resp.status == 200
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {3: 12.0, 40: -6.5})])
    steered, plain = _direct(llama, steering=spec), _direct(llama)
    assert steered.text != plain.text  # positive control: the steer changes the output
    body = resp.json()
    assert body["choices"][0]["text"] == steered.text
    assert resp.headers["x-millm-steering"] == (
        f'inline;sae={relu.id};layer=1;features=2;hash="{spec.canonical_hash()}"'
    )
    assert resp.json()["millm"]["steering"]["hash"] == spec.canonical_hash()
    millm = body["millm"]
    assert millm["steering"]["mode"] == "inline"
    assert millm["steering"]["entries"] == [{"sae_id": relu.id, "layer": 1, "features": features}]
    assert millm["steering_apply_count"] == [
        {"sae_id": relu.id, "layer": 1, "count": steered.forward_passes, "modes": {"add": steered.forward_passes}}
    ]


def test_empty_features_mean_unsteered_and_plain_requests_carry_no_millm(relu, llama):
    plain = _direct(llama)
    explicit = _complete(llama, steering={"features": []})
    assert explicit.json()["choices"][0]["text"] == plain.text
    assert explicit.headers["x-millm-steering"] == "none"
    assert explicit.json()["millm"]["steering"]["mode"] == "none"
    vanilla = _complete(llama)
    assert "millm" not in vanilla.json()
    assert vanilla.headers["x-millm-steering"] == "none"


def _lps(server, steering):
    """Log-probabilities of the greedy tokens: they tell strengths apart even where a
    saturating steer makes the tokens themselves the same."""
    ref = server.engine.generate_sync(
        GenerationJob(
            request_id="ref",
            prompt=PROMPT,
            steering=steering,
            sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True),
        ),
        timeout_s=60,
    )
    return [lp.logprob for lp in ref.logprobs]


def test_profile_with_intensity_is_scaled_and_clamped(relu, llama, openai_client):
    profile_create(
        name="sea-lover", sae_id=relu.id, layer=1, steering={"3": 150.0, "40": -20.0}, model_name="tiny-llama"
    )
    resp = _complete(llama, profile="sea-lover", steering_intensity=1.5, logprobs=0)
    # 150 × 1.5 = 225 → clamped to 200; -20 × 1.5 = -30
    clamped = _lps(llama, SteeringSpec([SteeringEntry(relu.id, 1, {3: 200.0, 40: -30.0})]))
    unit = _lps(llama, SteeringSpec([SteeringEntry(relu.id, 1, {3: 150.0, 40: -20.0})]))
    assert clamped != pytest.approx(unit, abs=1e-4)  # positive control
    got = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(clamped, abs=1e-5)
    clamped_spec = SteeringSpec([SteeringEntry(relu.id, 1, {3: 200.0, 40: -30.0})])
    assert resp.headers["x-millm-steering"] == (
        f'profile;name=sea-lover;intensity=1.5;hash="{clamped_spec.canonical_hash()}"'
    )
    # "<model>@<profile>" for clients that cannot send extra fields: intensity 1
    out = openai_client.completions.with_raw_response.create(
        model="tiny-llama@sea-lover",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert out.parse().choices[0].logprobs.token_logprobs == pytest.approx(unit, abs=1e-5)
    unit_spec = SteeringSpec([SteeringEntry(relu.id, 1, {3: 150.0, 40: -20.0})])
    assert out.headers["x-millm-steering"] == (
        f'profile;name=sea-lover;intensity=1;hash="{unit_spec.canonical_hash()}"'
    )
    off = _complete(llama, profile="sea-lover", steering_intensity="off")
    assert off.json()["choices"][0]["text"] == _direct(llama).text
    assert off.headers["x-millm-steering"] == "none"


def test_steering_refusals(relu, llama, openai_client):
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "x"}], extra_body={"profile": "no-such-profile"}
        )
    assert err.value.code == "profile_not_found"
    # checked once, against the SAE the engine holds, naming the field; with the dial at 0
    # nothing reaches the engine, and the web refuses the same index the same way
    for dial in ({}, {"steering_intensity": 0}):
        error = assert_openai_error(
            _complete(llama, steering={"features": [{"index": 256, "strength": 1}]}, **dial),
            400,
            "invalid_feature_index",
            "steering.features",
        )
        assert "256" in error["message"] and "d_sae=256" in error["message"], error
    assert_openai_error(
        _complete(llama, steering={"features": [{"index": 1, "strength": 201}]}),
        400,
        "invalid_parameter",
        "steering.features[0].strength",
    )
    assert_openai_error(
        _complete(llama, steering={"sae_id": "sae_nope", "features": [{"index": 1, "strength": 1}]}),
        400,
        "sae_not_attached",
    )
    assert_openai_error(_complete(llama, steering_intensity=2.5), 400, "invalid_parameter", "steering_intensity")
    attach("tiny-llama-L3-relu", 3)
    error = assert_openai_error(
        _complete(llama, steering={"features": [{"index": 1, "strength": 1}]}), 400, "ambiguous_sae", "steering.sae_id"
    )  # the same rule and code as /api's
    assert f"{relu.id}@1" in error["message"]  # names the choices
    profile_create(name="elsewhere", sae_id=relu.id, layer=2, steering={"1": 1.0})
    assert_openai_error(_complete(llama, profile="elsewhere"), 400, "profile_incompatible")


def test_sae_activations_equal_the_engine_monitor(relu, llama):
    asked = {"top_k": 4, "features": [3, 7], "positions": "all"}
    steer = {"features": [{"index": 3, "strength": 8.0}]}
    resp = _complete(llama, steering=steer, return_sae_activations=asked, max_tokens=6)
    assert resp.status == 200
    ref = _direct(
        llama,
        max_tokens=6,
        steering=SteeringSpec([SteeringEntry(relu.id, 1, {3: 8.0})]),
        monitor=MonitorSpec([MonitorEntry(relu.id, 1, top_k=4, features=[3, 7], positions="all")]),
    )
    acts = resp.json()["millm"]["sae_activations"]
    assert acts["sae_id"] == relu.id and acts["layer"] == 1
    assert acts["read_point"] == "post_steering"
    got = {row["position"]: row for row in acts["positions"]}
    assert sorted(got) == sorted(r.position for r in ref.activations)
    for rec in ref.activations:
        row = got[rec.position]
        assert [(a["feature_index"], a["activation"]) for a in row["top_k"]] == [
            (a.feature_index, pytest.approx(a.activation, abs=1e-6)) for a in rec.top_k
        ]
        assert [a["feature_index"] for a in row["features"]] == [3, 7]
        assert row["completion_token_index"] == rec.token_index
    n_prompt = acts["prompt_tokens"]
    assert got[n_prompt]["token_id"] == ref.token_ids[0]
    assert isinstance(got[0]["token"], str)
    # the same object arrives as the last chunk of a stream, before [DONE]
    stream = _complete(llama, steering=steer, return_sae_activations=asked, max_tokens=6, stream=True).events()
    assert stream[-1] == "[DONE]"
    assert stream[-2]["choices"] == []
    assert stream[-2]["millm"]["sae_activations"] == acts
    assert "".join(e["choices"][0]["text"] for e in stream[:-2]) == ref.text


def test_sae_activations_refusals(llama):
    assert_openai_error(
        _complete(llama, return_sae_activations={"top_k": 3}), 400, "sae_activations_refused"
    )  # nothing attached
    attach("tiny-llama-L1-relu", 1)
    assert_openai_error(_complete(llama, return_sae_activations={"top_k": 3}, n=2), 400, "sae_activations_refused")
    assert_openai_error(_complete(llama, return_sae_activations={"features": [999]}), 400, "sae_activations_refused")
    assert_openai_error(
        _complete(llama, return_sae_activations={"top_k": 0}), 400, "invalid_parameter", "return_sae_activations"
    )


def test_echo_logprobs_of_a_steered_request_are_its_own_prefill(relu, llama, openai_client, tiny_assets):
    """lm-eval's loglikelihood call through ``model@profile`` (echo, logprobs 3,
    max_tokens 0): the prompt's logprobs and alternatives are the steered forward's — equal
    to a float32 forward with the test's own hook adding the delta — from one forward pass;
    the unsteered model gives the plain forward's (positive control)."""
    from tests.engine.helpers import RefSAE, block, count_forwards, prompt_log_softmax

    features = {3: 12.0, 40: -6.5}
    profile_create(
        name="ll-steer",
        sae_id=relu.id,
        layer=1,
        steering={str(i): s for i, s in features.items()},
        model_name="tiny-llama",
    )
    engine = llama.engine
    tok = engine.backend.tokenizer
    ids = engine.backend.encode_text(PROMPT)
    delta = RefSAE(tiny_assets.saes["tiny-llama-L1-relu"]).delta(features)
    steered_ref = prompt_log_softmax(engine, ids, steer=(block(engine, tiny_assets.models["tiny-llama"], 1), delta))
    plain_ref = prompt_log_softmax(engine, ids)

    def text(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def check(model: str, lsm) -> list:
        with count_forwards(engine.backend.model) as n:
            out = openai_client.completions.create(
                model=model, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0, temperature=0
            )
        assert n[0] == 1  # one prefill, whatever the prompt's length
        choice = out.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp.tokens == [text(t) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(ids)):
            row = lsm[j - 1]
            want = {text(int(t)): float(row[t]) for t in row.argsort()[::-1][:3]}
            want.setdefault(text(ids[j]), float(row[ids[j]]))
            assert lp.token_logprobs[j] == pytest.approx(row[ids[j]], abs=1e-5)
            assert set(lp.top_logprobs[j]) == set(want), j
            assert lp.top_logprobs[j] == pytest.approx(want, abs=1e-5)
        return lp.token_logprobs[1:]

    steered = check("tiny-llama@ll-steer", steered_ref)
    plain = check("tiny-llama", plain_ref)
    assert steered != pytest.approx(plain, abs=1e-3)  # the steer moved the log-likelihoods
