"""A steering spec's ranges are checked once on its way from the /v1 body to the hook
(docs/engine.md, "A steering spec's shapes"): the body's model refuses an out-of-range
strength naming the same parameter the engine API names, and what it let through becomes
the engine's structs without a second check by hand."""

from __future__ import annotations

import re

import msgspec
import pytest
from pydantic import ValidationError

from gpu_engine.api import fields
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachmentStatus,
    FeatureControl,
    GenerationJob,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
    from_json,
    to_json,
)
from inference.errors import openai_error_from_validation
from inference.protocol import ChatCompletionRequest
from steering.services import steering_resolve_request

CHAT = [{"role": "user", "content": "hi"}]


def _v1_refusal(feature: dict) -> tuple[int, str, str | None]:
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "steering": {"features": [feature]}})
    error = openai_error_from_validation(err.value)
    return error.status, error.code, error.param


def _engine_refusal(build) -> str | None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidParameter) as err:
        build()
    return err.value.param


def _job_json(strength: float) -> bytes:
    """A generation job as the web's Redis client sends it, with ``strength`` unchecked."""
    job = GenerationJob("r", prompt="x", sampling=SamplingParams())
    data = msgspec.json.decode(to_json(job))
    data["steering"] = {"entries": [{"sae_id": "s", "layer": 1, "features": {"3": strength}}]}
    return msgspec.json.encode(data)


@pytest.mark.parametrize("strength", [201.0, -200.5])
def test_an_out_of_range_strength_is_refused_naming_the_same_parameter_on_v1_and_the_engine_api(strength):
    status, code, v1_param = _v1_refusal({"index": 3, "strength": strength})
    assert (status, code, v1_param) == (400, "invalid_parameter", "steering.features[0].strength")
    built = _engine_refusal(lambda: SteeringEntry("s", 1, {3: strength}))
    decoded = _engine_refusal(lambda: from_json(_job_json(strength), GenerationJob))
    # the same parameter, /v1 naming the list position too
    assert re.sub(r"\[\d+\]", "", v1_param) == built == decoded == "steering.features.strength"


def test_an_out_of_range_control_value_is_refused_naming_the_same_parameter():
    status, code, v1_param = _v1_refusal({"index": 3, "mode": "clamp", "value": 500})
    assert (status, code, v1_param) == (400, "invalid_parameter", "steering.features[0].value")
    engine = _engine_refusal(lambda: FeatureControl(3, mode="clamp", value=500.0))
    assert re.sub(r"\[\d+\]", "", v1_param) == engine == "steering.features.value"


def test_what_the_body_checked_reaches_the_engine_structs_without_a_second_check(monkeypatch):
    """The body's model checks each range; the resolver builds the FeatureControls and the
    SteeringEntry from it, and the codec decodes it on the engine's side, without
    ``check_fields`` checking a steering field again (a spy on each steering struct's
    checks counts none), yet the values arrive as sent."""
    checked: list[str] = []
    FeatureControl(0), SteeringEntry("s", 0)  # each struct's checks, cached on first use
    for cls in (FeatureControl, SteeringEntry):
        monkeypatch.setitem(
            fields._CHECKS,
            cls,
            tuple(
                (
                    name,
                    lambda value, where=f"{cls.__name__}.{name}", check=check: (checked.append(where), check(value))[1],
                )
                for name, check in fields._CHECKS[cls]
            ),
        )
    assert any(name == "features" for name, _ in fields._CHECKS[SteeringEntry])
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": CHAT,
            "steering": {"features": [{"index": 3, "strength": 200.0}, {"index": 5, "mode": "clamp", "value": -7.5}]},
        }
    )
    att = AttachmentStatus("sae_a", 1, "model.layers.1", 8, 16, "relu", "saelens", "/x")
    resolved = steering_resolve_request(attachments=[att], inline_features=[f.control() for f in req.steering.features])
    job = GenerationJob("r", prompt="x", sampling=SamplingParams(), steering=resolved.spec)
    decoded = from_json(to_json(job), GenerationJob)
    assert checked == []
    for spec in (resolved.spec, decoded.steering):
        assert isinstance(spec, SteeringSpec)
        (entry,) = spec.entries
        assert entry.features == {3: 200.0}
        assert [(c.index, c.mode, c.value) for c in entry.controls] == [(5, "clamp", -7.5)]
    # the positive control: a struct built by hand is checked
    SteeringEntry("s", 1, {3: 1.0})
    assert checked
