"""Jobs, events and errors cross a process boundary as JSON and come back equal."""

from __future__ import annotations

import json

import pytest

from gpu_engine.api.errors import ContextLengthExceeded, EngineError, InvalidParameter, error_from_dict
from gpu_engine.api.protocol import (
    ActivationRecord,
    AttachmentStatus,
    AttachResult,
    EmbedJob,
    EngineStatus,
    ErrorEvent,
    FeatureActivation,
    FeatureControl,
    FinishEvent,
    GenerationJob,
    GenerationResult,
    LoadModelJob,
    LogprobEntry,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    ScoreJob,
    SteeringCondition,
    SteeringCount,
    SteeringEntry,
    SteeringSpec,
    StreamEvent,
    TokenEvent,
    TokenLogprob,
    Usage,
    from_builtins,
    from_json,
    to_builtins,
    to_json,
)


def roundtrip(obj):
    """Through JSON text, as the Redis transport carries it."""
    return from_json(json.dumps(json.loads(to_json(obj))), type(obj))


def test_generation_job_roundtrip_keeps_tuple_keyed_steering():
    job = GenerationJob(
        "r1",
        messages=[{"role": "user", "content": "hi"}],
        sampling=SamplingParams(
            max_tokens=7,
            temperature=0.5,
            seed=3,
            stop=["\n\n"],
            logprobs=True,
            top_logprobs=2,
            logit_bias={5: 100.0, 17: -2.5},
        ),
        steering=SteeringSpec.from_mapping({("sae-a", 3): {10: 2.5, 7: -1.0}, ("sae-b", 5): {}}),
        monitor=MonitorSpec(
            [
                MonitorEntry("sae-a", 3, top_k=5, positions=PositionRange(1, 9)),
                MonitorEntry("sae-a", 3, features=[1], read_point="pre_steering", positions="last"),
            ]
        ),
    )
    wire = json.loads(to_json(job))
    assert wire["steering"]["entries"][0] == {"sae_id": "sae-a", "layer": 3, "features": {"10": 2.5, "7": -1.0}}
    assert wire["monitor"]["entries"][0]["positions"] == {"start": 1, "end": 9}
    assert wire["monitor"]["entries"][1]["positions"] == "last"
    assert wire["sampling"]["logit_bias"] == {"5": 100.0, "17": -2.5}
    back = roundtrip(job)
    assert back == job
    assert back.steering.as_mapping() == {("sae-a", 3): {10: 2.5, 7: -1.0}, ("sae-b", 5): {}}


def test_feature_controls_travel_and_a_plain_add_given_as_a_control_is_a_strength():
    entry = SteeringEntry(
        "sae-a",
        3,
        {1: 2.0},
        [
            FeatureControl(
                4,
                mode="clamp",
                value=3.0,
                phase="completion",
                window=PositionRange(2, None),
                condition=SteeringCondition(9, 0.5),
            ),
            {"index": 5, "mode": "add", "value": -1.5},  # plain: joins the strengths
            {"index": 6, "mode": "ablate"},
        ],
    )
    assert entry.features == {1: 2.0, 5: -1.5}
    assert [c.index for c in entry.controls] == [4, 6]
    wire = json.loads(to_json(SteeringSpec([entry])))["entries"][0]
    assert wire["controls"][0] == {
        "index": 4,
        "mode": "clamp",
        "value": 3.0,
        "phase": "completion",
        "window": {"start": 2, "end": None},
        "condition": {"feature": 9, "threshold": 0.5},
    }
    assert wire["controls"][1] == {"index": 6, "mode": "ablate"}
    back = from_json(to_json(SteeringSpec([entry])), SteeringSpec)
    assert back == SteeringSpec([entry])


def test_events_and_results_roundtrip():
    rec = ActivationRecord("s", 1, "post_steering", 4, 0, [FeatureActivation(3, 1.5)], [FeatureActivation(9, 0.0)])
    tok = TokenEvent("r", 0, 42, "hi", TokenLogprob(42, "hi", -0.1, [LogprobEntry(42, "hi", -0.1)]), [rec])
    fin = FinishEvent(
        "r",
        "stop",
        "hi",
        [42],
        Usage(3, 1, 4),
        [1, 2, 3],
        [None, -1.0, -2.0],
        [rec],
        [SteeringCount("s", 1, 1)],
        1,
        prompt_top_logprobs=[None, [LogprobEntry(2, "b", -1.0)], [LogprobEntry(5, "e", -0.5)]],
    )
    err = ErrorEvent("r", "context_length_exceeded", "too long", {"prompt_tokens": 9})
    for ev, tag in ((tok, "token"), (fin, "finish"), (err, "error")):
        assert json.loads(to_json(ev))["type"] == tag
        assert from_json(to_json(ev), StreamEvent) == ev
    res = GenerationResult.from_events([tok, fin])
    assert roundtrip(res) == res and res.activations == [rec, rec]
    assert res.prompt_top_logprobs == fin.prompt_top_logprobs  # echo's alternatives travel
    for obj in (
        EngineStatus(
            "ready", attachments=[AttachmentStatus("s", 1, "model.layers.1", 64, 256, "relu", "saelens", "/p", 3)]
        ),
        AttachResult("s", 1, "model.layers.1", 64, 256, "relu", "saelens", ["w"]),
        LoadModelJob("m", "/p", dtype="bfloat16"),
        EmbedJob("e", ["a", [1, 2]]),
        ScoreJob("s", prompt_token_ids=[1, 2], allowed_token_ids=[3]),
    ):
        assert roundtrip(obj) == obj
        assert from_builtins(json.loads(json.dumps(to_builtins(obj))), type(obj)) == obj


def test_decoding_validates_like_constructing():
    """A job decoded from JSON is checked by the same rules as one built in Python, and a
    value of the wrong type is refused naming where it is."""
    good = json.loads(to_json(GenerationJob("r", prompt="x", sampling=SamplingParams(top_p=0.5))))
    good["sampling"]["top_p"] = 0
    with pytest.raises(InvalidParameter) as err:
        from_json(json.dumps(good), GenerationJob)
    assert err.value.param == "top_p"
    good["sampling"]["top_p"] = "high"
    with pytest.raises(InvalidParameter) as err:
        from_json(json.dumps(good), GenerationJob)
    assert err.value.param == "sampling.top_p"
    good["sampling"]["top_p"] = 0.5
    good["from_a_newer_build"] = True  # unknown fields are ignored
    assert from_json(json.dumps(good), GenerationJob).sampling.top_p == 0.5


def test_errors_roundtrip_by_code():
    err = ContextLengthExceeded(prompt_tokens=10, max_tokens=5, context_length=12)
    back = error_from_dict(json.loads(json.dumps(err.to_dict())))
    assert type(back) is ContextLengthExceeded and back.details == err.details and str(back) == str(err)
    bad = ErrorEvent("r", "invalid_parameter", "m", {"param": "top_p"}).to_exception()
    assert isinstance(bad, InvalidParameter) and bad.param == "top_p"
    unknown = error_from_dict({"code": "from_the_future", "message": "?"})
    assert isinstance(unknown, EngineError) and unknown.code == "from_the_future"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ],
)
def test_sampling_validation_names_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and err.value.code == "invalid_parameter"


def test_template_kwargs_the_engine_sets_are_refused_by_name():
    """Any engine client (the web tier, run_engine's stream, the Python client): a key the
    engine passes itself when it renders a chat template is refused naming it."""
    msgs = [{"role": "user", "content": "hi"}]
    for key in ("messages", "add_generation_prompt", "tokenize", "tools", "conversation"):
        for make in (
            lambda kw: GenerationJob("r", messages=msgs, chat_template_kwargs=kw),
            lambda kw: ScoreJob("s", messages=msgs, chat_template_kwargs=kw),
        ):
            with pytest.raises(InvalidParameter) as err:
                make({key: []})
            assert err.value.param == f"chat_template_kwargs.{key}"
    assert GenerationJob("r", messages=msgs, chat_template_kwargs={"enable_thinking": False})


def test_job_needs_exactly_one_prompt_form():
    with pytest.raises(InvalidParameter):
        GenerationJob("r")
    with pytest.raises(InvalidParameter):
        GenerationJob("r", prompt="a", prompt_token_ids=[1])
    with pytest.raises(InvalidParameter, match="asks for nothing"):
        MonitorEntry("s", 1)
