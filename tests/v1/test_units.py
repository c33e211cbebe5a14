"""The pieces under /v1 on their own: the error mapping (every 503 with the Retry-After
of its setting) and the steering resolver's rules."""

from __future__ import annotations

import pytest
from django.conf import settings

from core import errors as domain
from gpu_engine.api import errors as engine_errors
from gpu_engine.api.protocol import AttachmentStatus
from inference.admission import QueueFull
from inference.errors import openai_error_from_exception, openai_error_response
from inference.residency import ModelLoading, ModelNotResident
from registry import errors as registry_errors
from steering.errors import AmbiguousSAE, ProfileNotFound, SteeringInvalid
from steering.services import profile_create, steering_resolve_request

CASES = [
    (engine_errors.ModelNotLoaded("x"), 503, "model_not_loaded", "RETRY_AFTER_NOT_LOADED_S"),
    (engine_errors.InsufficientMemory("x"), 503, "insufficient_memory", "RETRY_AFTER_MEMORY_S"),
    (engine_errors.EngineBusy("x"), 503, "model_busy", "RETRY_AFTER_LOAD_S"),
    (domain.ModelBusy("x"), 503, "model_busy", "RETRY_AFTER_LOAD_S"),
    (ModelLoading("x"), 503, "model_loading", "RETRY_AFTER_LOAD_S"),
    (QueueFull("x"), 503, "queue_full", "RETRY_AFTER_QUEUE_DEFAULT_S"),
    (domain.InsufficientMemory("x"), 503, "insufficient_memory", "RETRY_AFTER_MEMORY_S"),
    (
        engine_errors.ContextLengthExceeded(prompt_tokens=9, max_tokens=9, context_length=10),
        400,
        "context_length_exceeded",
        None,
    ),
    (engine_errors.InvalidParameter("x", param="top_p"), 400, "invalid_parameter", None),
    (engine_errors.InvalidFeatureIndex(sae_id="s", index=9, d_sae=4), 400, "invalid_feature_index", None),
    (registry_errors.ModelNotFound("x"), 404, "model_not_found", None),
    (ProfileNotFound("x"), 404, "profile_not_found", None),
    (ModelNotResident("x"), 409, "model_not_resident", None),
    (registry_errors.ModelLocked("x"), 409, "model_locked", None),
    (SteeringInvalid("x", details={"param": "steering.sae_id"}), 400, "invalid_parameter", None),
    (RuntimeError("secret internals"), 500, "internal_error", None),
]


@pytest.mark.parametrize("exc,status,code,retry_setting", CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_error_mapping(exc, status, code, retry_setting):
    error = openai_error_from_exception(exc)
    assert (error.status, error.code) == (status, code)
    response = openai_error_response(error)
    assert response.status_code == status
    if retry_setting:
        assert response["Retry-After"] == str(getattr(settings, retry_setting))
    else:
        assert not response.has_header("Retry-After")
    assert "secret" not in response.content.decode()


def _att(sae_id="sae_a", layer=1, d_sae=16):
    return AttachmentStatus(sae_id, layer, f"model.layers.{layer}", 8, d_sae, "relu", "saelens", "/x")


def test_resolver_inline_rules():
    one = [_att()]
    res = steering_resolve_request(attachments=one, inline_features=[(3, 5.0)])
    assert res.spec.as_mapping() == {("sae_a", 1): {3: 5.0}}
    assert res.header == "inline;sae=sae_a;layer=1;features=1"
    dialled = steering_resolve_request(attachments=one, inline_features=[(3, 150.0), (4, -1.0)], intensity=2.0)
    assert dialled.spec.as_mapping() == {("sae_a", 1): {3: 200.0, 4: -2.0}}  # clamped
    assert dialled.header.endswith(";intensity=2")
    assert steering_resolve_request(attachments=one, inline_features=[]).spec.is_empty()
    assert steering_resolve_request(attachments=one).spec is None  # nothing asked
    with pytest.raises(AmbiguousSAE):  # one rule for every surface: AMBIGUOUS_SAE
        steering_resolve_request(attachments=[_att(), _att("sae_b", 2)], inline_features=[(1, 1.0)])
    # the engine's plan check is the one range check of what reaches it (tests/v1/test_steering.py
    # sees its 400 on /v1); the resolver refuses an index only where nothing reaches the engine
    with pytest.raises(domain.InvalidFeatureIndex):
        steering_resolve_request(attachments=one, inline_features=[(16, 1.0)], intensity=0.0)
    with pytest.raises(domain.SAENotAttached):
        steering_resolve_request(attachments=[], inline_features=[(1, 1.0)])
    with pytest.raises(SteeringInvalid):
        steering_resolve_request(attachments=one, inline_features=[(1, 1.0), (1, 2.0)])


@pytest.mark.django_db
def test_resolver_profile_rules():
    profile_create(name="caf\u00e9; x=1", sae_id="sae_a", layer=1, steering={"2": -150, "5": 10})
    res = steering_resolve_request(attachments=[_att()], profile="caf\u00e9; x=1", intensity=1.5)
    assert res.spec.as_mapping() == {("sae_a", 1): {2: -200.0, 5: 15.0}}
    assert res.header == "profile;name=caf%C3%A9%3B%20x%3D1;intensity=1.5"
    res.header.encode("ascii")  # a header value must be ASCII
    assert steering_resolve_request(attachments=[], profile="caf\u00e9; x=1").header == "none"
    with pytest.raises(ProfileNotFound):
        steering_resolve_request(attachments=[_att()], profile="nope")
    with pytest.raises(SteeringInvalid):
        steering_resolve_request(attachments=[_att()], profile="caf\u00e9; x=1", inline_features=[(1, 1.0)])
    with pytest.raises(domain.MillmError) as err:  # values set directly are checked
        profile_create(name="too-strong", sae_id="sae_a", layer=1, steering={"1": 201})
    assert err.value.code == "VALIDATION_ERROR"
