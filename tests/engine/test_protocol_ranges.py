"""A value range is declared once (gpu_engine.api.fields): a message built in Python and
the same message decoded from JSON are refused at the same bound, naming the same
parameter, and the web's /v1 model refuses at that bound too."""

from __future__ import annotations

import json

import pytest

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    BatchingOptions,
    CaptureSpec,
    FeatureControl,
    GenerationJob,
    MonitorEntry,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
    from_builtins,
    from_json,
)


def _refused(make) -> InvalidParameter:
    with pytest.raises(InvalidParameter) as err:
        make()
    assert err.value.code == "invalid_parameter"
    return err.value


def _job(**fields) -> dict:
    return {"request_id": "r", "prompt": "x", **fields}


def _steer(entry: dict) -> dict:
    return _job(steering={"entries": [{"sae_id": "s", "layer": 1, **entry}]})


# (built in Python, the same as a JSON body, the parameter both name)
CASES = [
    (lambda: SteeringEntry("s", 1, {3: 200.5}), _steer({"features": {"3": 200.5}}), "steering.features.strength"),
    (lambda: SteeringEntry("s", 1, {-3: 1.0}), _steer({"features": {"-3": 1.0}}), "steering.features.index"),
    (lambda: SteeringEntry("", 1), _steer({"sae_id": ""}), "steering.sae_id"),
    (
        lambda: FeatureControl(2, mode="clamp", value=-201.0),
        _steer({"controls": [{"index": 2, "mode": "clamp", "value": -201.0}]}),
        "steering.features.value",
    ),
    (
        lambda: FeatureControl(2, mode="boost"),
        _steer({"controls": [{"index": 2, "mode": "boost"}]}),
        "steering.features.mode",
    ),
    (
        lambda: SteeringCondition(4, 1e7),
        _steer(
            {"controls": [{"index": 2, "mode": "clamp", "value": 1.0, "condition": {"feature": 4, "threshold": 1e7}}]}
        ),
        "steering.condition.threshold",
    ),
    (lambda: SamplingParams(top_p=0.0), _job(sampling={"top_p": 0.0}), "top_p"),
    (lambda: SamplingParams(presence_penalty=2.5), _job(sampling={"presence_penalty": 2.5}), "presence_penalty"),
    (lambda: SamplingParams(logit_bias={5: -100.5}), _job(sampling={"logit_bias": {"5": -100.5}}), "logit_bias"),
    (lambda: SamplingParams(stop=["a", "b", "c", "d", "e"]), _job(sampling={"stop": list("abcde")}), "stop"),
    (lambda: SamplingParams(stop_token_ids=[3, -1]), _job(sampling={"stop_token_ids": [3, -1]}), "stop_token_ids"),
    (
        lambda: MonitorEntry("s", 1, top_k=1025),
        _job(monitor={"entries": [{"sae_id": "s", "layer": 1, "top_k": 1025}]}),
        "monitor.top_k",
    ),
    (
        lambda: MonitorEntry("s", 1, top_k=1, read_point="middle"),
        _job(monitor={"entries": [{"sae_id": "s", "layer": 1, "top_k": 1, "read_point": "middle"}]}),
        "monitor.read_point",
    ),
    (lambda: CaptureSpec([1], max_bytes=-1), _job(capture={"layers": [1], "max_bytes": -1}), "capture.max_bytes"),
    (lambda: GenerationJob("r", prompt_token_ids=[1, -2]), {"request_id": "r", "prompt_token_ids": [1, -2]}, "prompt"),
    (lambda: GenerationJob("r", prompt="x", priority="urgent"), _job(priority="urgent"), "priority"),
]


@pytest.mark.parametrize("build, body, param", CASES)
def test_built_and_decoded_are_refused_naming_the_same_parameter(build, body, param):
    assert _refused(build).param == param
    assert _refused(lambda: from_json(json.dumps(body), GenerationJob)).param == param
    assert _refused(lambda: from_builtins(body, GenerationJob)).param == param


def test_the_bounds_themselves_are_allowed():
    spec = SteeringSpec([SteeringEntry("s", 1, {0: 200.0, 1: -200.0}, [FeatureControl(2, mode="clamp", value=-200.0)])])
    assert spec.entries[0].features == {0: 200.0, 1: -200.0}
    sampling = SamplingParams(
        top_p=1.0, presence_penalty=-2.0, logit_bias={0: 100.0}, top_logprobs=20, repetition_penalty=10.0, top_k=-1
    )
    decoded = from_json(
        json.dumps(
            _job(
                sampling={
                    "top_p": 1.0,
                    "presence_penalty": -2.0,
                    "logit_bias": {"0": 100},
                    "top_logprobs": 20,
                    "repetition_penalty": 10,
                    "top_k": -1,
                }
            )
        ),
        GenerationJob,
    )
    assert decoded.sampling == sampling
    assert BatchingOptions(max_batch_size=4096, gather_ms=0).max_batch_size == 4096


def test_an_integer_for_a_float_field_is_kept_as_a_float():
    """The JSON the engine sends on is the same whichever way a caller wrote the number."""
    built = SamplingParams(temperature=1, top_p=1)
    assert type(built.temperature) is float and type(built.top_p) is float
    assert SteeringEntry("s", 1, {3: 2}).features == {3: 2.0}
    assert type(SteeringEntry("s", 1, {3: 2}).features[3]) is float


def test_a_wrong_shape_names_where_it_is():
    err = _refused(lambda: from_json(json.dumps(_job(sampling={"top_p": "high"})), GenerationJob))
    assert err.param == "sampling.top_p"
    err = _refused(lambda: SamplingParams(temperature=True))
    assert err.param == "temperature"


@pytest.mark.parametrize(
    "field, refused, allowed",
    [
        ("top_p", 0.0, 1.0),
        ("presence_penalty", 2.01, -2.0),
        ("frequency_penalty", -2.01, 2.0),
        ("repetition_penalty", 0.0, 10.0),
        ("top_k", -2, -1),
    ],
)
def test_the_v1_model_refuses_where_the_engine_does(field, refused, allowed):
    """The /v1 body and the engine's job share the declared bound (inference.protocol
    reads it from gpu_engine.api)."""
    pydantic = pytest.importorskip("pydantic")
    from inference.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({**body, field: refused})
    _refused(lambda: SamplingParams(**{field: refused}))
    assert getattr(ChatCompletionRequest.model_validate({**body, field: allowed}), field) == allowed
    assert getattr(SamplingParams(**{field: allowed}), field) == allowed
