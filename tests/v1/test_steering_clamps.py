"""The RhizoNymph vLLM fork's clamps on /v1 (docs/api-v1.md, "Steering shapes from other
tools"): ``steering_clamps`` and its ``prefill_`` / ``decode_`` tiers, sent through the
official ``openai`` client's ``extra_body``, give the tokens of the native clamp vector
(``steering.vectors[i].mode: clamp``, docs/steering.md "Inline vectors") of their phase,
with a positive control (the clamp changes the answer) and the steering hash of the
native vector; every malformed clamp is a 400 naming its field, nothing run."""

from __future__ import annotations

import pytest

from gpu_engine.api.protocol import SteeringEntry, SteeringSpec
from gpu_engine.api.steering import SteeringVector
from gpu_engine.api.vectors import pack
from tests.v1.test_steering import relu  # noqa: F401 - fixture
from tests.v1.test_steering_aliases import _counts, _raw, _tokens, row  # noqa: F401 - fixture

# a projection far outside the rows' own along W_dec[3]: the clamp moves the answer
VALUE = 40.0
TIERS = [("steering_clamps", "all"), ("prefill_steering_clamps", "prompt"), ("decode_steering_clamps", "completion")]


def _native(row, phase="all", **bounds):
    vector = {"data": pack(row), "layer": 1, "mode": "clamp", "phase": phase, **bounds}
    return {"steering": {"vectors": [vector]}}


@pytest.mark.parametrize(("tier", "phase"), TIERS)
def test_the_forks_clamps_are_clamp_vectors_of_their_phase(relu, llama, openai_client, row, tier, phase):
    got, headers = _tokens(openai_client, **{tier: {"post_block": {"1": [{"vector": row.tolist(), "value": VALUE}]}}})
    native, _ = _tokens(openai_client, **_native(row, phase, min=VALUE, max=VALUE))
    sugar, _ = _tokens(openai_client, **_native(row, phase, value=VALUE))
    plain, _ = _tokens(openai_client)
    assert got == native == sugar
    assert got != plain  # positive control
    assert "x-millm-ignored-fields" not in headers
    vector = SteeringVector(row.tobytes(), "float32", 1.0, phase, mode="clamp", min=VALUE, max=VALUE)
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {}, [], [vector])])
    assert headers["x-millm-steering"].endswith(f'hash="{spec.canonical_hash()}"')
    # packed like the fork's vectors, at pre_attn of layer 2 (block 1's output as well)
    packed, _ = _tokens(openai_client, **{tier: {"pre_attn": {"2": [{"vector": pack(row), "value": VALUE}]}}})
    assert packed == got


def test_bounds_strength_and_order_map_as_sent(relu, llama, openai_client, row):
    clamps = [{"vector": row.tolist(), "min": VALUE, "strength": 0.5}, {"vector": (-row).tolist(), "max": -VALUE / 2}]
    got, _ = _tokens(openai_client, steering_clamps={"post_block": {"1": clamps}})
    native = [
        {"data": pack(row), "layer": 1, "mode": "clamp", "min": VALUE, "strength": 0.5},
        {"data": pack(-row), "layer": 1, "mode": "clamp", "max": -VALUE / 2},
    ]
    want, _ = _tokens(openai_client, steering={"vectors": native})
    plain, _ = _tokens(openai_client)
    assert got == want
    assert got != plain
    # base and tier together: the base clamps, then the tier's, on the tier's rows
    both, _ = _tokens(
        openai_client,
        steering_clamps={"post_block": {"1": [{"vector": row.tolist(), "value": VALUE}]}},
        decode_steering_clamps={"post_block": {"1": [{"vector": row.tolist(), "value": -VALUE}]}},
    )
    native = [
        {"data": pack(row), "layer": 1, "mode": "clamp", "value": VALUE},
        {"data": pack(row), "layer": 1, "mode": "clamp", "value": -VALUE, "phase": "completion"},
    ]
    want, _ = _tokens(openai_client, steering={"vectors": native})
    assert both == want


def _clamp(**entry):
    return {"steering_clamps": {"post_block": {"1": [{"vector": [0.0, 1.0, 0.0, 0.0], **entry}]}}}


AT = "steering_clamps.post_block.1[0]"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (_clamp(value=1.0, min=0.0), f"{AT}.value"),
        (_clamp(), AT),
        (_clamp(min=2.0, max=1.0), f"{AT}.min"),
        (_clamp(value=1.0, strength=1.5), f"{AT}.strength"),
        (_clamp(value=1.0, strength=-0.1), f"{AT}.strength"),
        (_clamp(value=1.0, strength=True), f"{AT}.strength"),
        (_clamp(value="1"), f"{AT}.value"),
        (_clamp(max=1e300), f"{AT}.max"),
        (_clamp(value=1.0, scale=2.0), f"{AT}.scale"),
        ({"steering_clamps": {"post_block": {"1": [{"vector": [0.0, 0.0], "value": 1.0}]}}}, f"{AT}.vector"),
        (_clamp(value=1.0), f"{AT}.vector"),  # 4 wide: not the stream's width
        ({"steering_clamps": {"post_block": {"1": {"vector": [1.0], "value": 1.0}}}}, "steering_clamps.post_block.1"),
        ({"steering_clamps": {"post_block": {"x": []}}}, "steering_clamps.post_block.x"),
        ({"steering_clamps": {"post_attn": {}}}, "steering_clamps.post_attn"),
        ({"decode_steering_clamps": [1]}, "decode_steering_clamps"),
        (
            {"prefill_steering_clamps": {"post_block": {"5": [{"vector": [1.0] * 64, "value": 1.0}]}}},
            "prefill_steering_clamps.post_block.5",
        ),  # nothing attached there
        ({"steering": {"features": []}, "steering_clamps": _clamp(value=1.0)["steering_clamps"]}, "steering_clamps"),
    ],
)
def test_a_malformed_clamp_is_a_400_naming_the_field_and_nothing_runs(relu, llama, extra, param):
    before = _counts(llama)
    resp = _raw(llama, **extra)
    assert resp.status == 400, resp.body[:300]
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["code"] in ("invalid_parameter", "sae_not_attached"), error
    assert "Traceback" not in error["message"]
    assert _counts(llama) == before


@pytest.mark.parametrize(
    "vector",
    [
        {"mode": "clamp"},
        {"mode": "clamp", "min": 1.0, "max": 0.0},
        {"mode": "clamp", "value": 1.0, "max": 2.0},
        {"mode": "clamp", "value": 1.0, "strength": 2.0},
        {"min": 1.0},
    ],
)
def test_a_malformed_native_clamp_is_refused_and_nothing_runs(relu, llama, row, vector):
    before = _counts(llama)
    resp = _raw(llama, steering={"vectors": [{"data": pack(row), "layer": 1, **vector}]})
    assert resp.status == 400, resp.body[:300]
    error = resp.json()["error"]
    assert (error["param"] or "").startswith("steering.vectors"), error
    assert "Traceback" not in error["message"]
    assert _counts(llama) == before


def test_the_response_reports_each_clamps_bounds(relu, llama, row):
    resp = _raw(llama, steering_clamps={"post_block": {"1": [{"vector": row.tolist(), "min": -1.0, "strength": 0.25}]}})
    assert resp.status == 200, resp.body[:300]
    (vector,) = resp.json()["millm"]["steering"]["entries"][0]["vectors"]
    assert vector["mode"] == "clamp" and vector["min"] == -1.0 and vector["max"] is None
    assert vector["strength"] == 0.25 and vector["phase"] == "all"
