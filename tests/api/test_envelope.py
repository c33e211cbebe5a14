"""One error shape for every /api route: domain errors, DRF's own refusals, unknown paths,
unexpected exceptions; and every 503 carries Retry-After."""

from __future__ import annotations

import logging

import pytest

from core.errors import EngineUnavailable, ModelBusy
from tests.api.conftest import body, ok, refused

pytestmark = pytest.mark.django_db


def test_success_envelope(api):
    data = ok(api.get("/api/models"))
    assert data == {"models": [], "total": 0, "loaded_model_id": None, "loaded_models": {}}


def test_unknown_api_path_is_an_enveloped_404(api):
    error = refused(api.get("/api/no/such/route"), 404, "NOT_FOUND")
    assert "/api/no/such/route" in error["message"]
    refused(api.post("/api/models/1/launch"), 404, "NOT_FOUND")
    # the rest of the site keeps Django's own pages
    assert api.get("/nowhere").status_code == 404
    assert b"success" not in api.get("/nowhere").content


def test_method_not_allowed(api):
    refused(api.delete("/api/health"), 405, "METHOD_NOT_ALLOWED")
    refused(api.put("/api/models", {}, format="json"), 405, "METHOD_NOT_ALLOWED")


def test_validation_errors_are_422_with_the_field_errors(api):
    error = refused(
        api.post("/api/saes/download", {"repository_id": "no-slash", "revision": 7 * "x" * 20}, format="json"),
        422,
        "VALIDATION_ERROR",
    )
    fields = error["details"]["fields"]
    assert set(fields) == {"repository_id", "revision"}
    assert all(isinstance(v, list) and v for v in fields.values())

    error = refused(api.post("/api/saes/sae_0123/attach", {"layer": -1}, format="json"), 422, "VALIDATION_ERROR")
    assert "layer" in error["details"]["fields"]
    error = refused(api.post("/api/saes/attach-set", {"attachments": []}, format="json"), 422, "VALIDATION_ERROR")
    assert "attachments" in error["details"]["fields"]


def test_a_body_that_is_not_json_is_a_validation_error(api):
    error = refused(api.post("/api/models", "{not json", content_type="application/json"), 422, "VALIDATION_ERROR")
    assert "body" in error["details"]["fields"]
    refused(
        api.post("/api/models", "a=b", content_type="application/x-www-form-urlencoded"), 415, "UNSUPPORTED_MEDIA_TYPE"
    )


def test_a_body_too_large_or_too_deep_is_refused_not_a_500(api, settings):
    deep = "[" * 100_000 + "]" * 100_000
    error = refused(api.post("/api/saes/steering", deep, content_type="application/json"), 422, "VALIDATION_ERROR")
    assert error["details"]["fields"] == {"body": ["nested too deeply"]}
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    big = '{"steering": {"1": 1.0}, "pad": "' + "x" * 2000 + '"}'
    error = refused(
        api.post("/api/saes/steering/batch", big, content_type="application/json"), 413, "PAYLOAD_TOO_LARGE"
    )
    assert error["details"] == {"limit_bytes": 1000}


def test_unexpected_exception_is_a_500_without_traceback(api, monkeypatch, caplog):
    from registry import selectors

    def boom():
        raise RuntimeError("secret internals /srv/millm/registry.py line 12")

    monkeypatch.setattr(selectors, "model_list", boom)
    with caplog.at_level(logging.ERROR):
        response = api.get("/api/models")
    error = refused(response, 500, "INTERNAL_ERROR")
    assert "secret internals" not in response.content.decode()
    assert "Traceback" not in response.content.decode()
    assert error["details"] == {}
    assert any("api_unhandled_exception" in r.getMessage() for r in caplog.records)


def test_every_503_carries_retry_after(api, monkeypatch, settings, caplog):
    from registry import selectors

    def busy():
        raise ModelBusy("busy", retry_after=settings.RETRY_AFTER_UNLOAD_S)

    monkeypatch.setattr(selectors, "model_list", busy)
    response = api.get("/api/models")
    refused(response, 503, "MODEL_BUSY")
    assert response["Retry-After"] == str(settings.RETRY_AFTER_UNLOAD_S)

    def unavailable():
        raise EngineUnavailable("engine away")  # no retry_after given

    monkeypatch.setattr(selectors, "model_list", unavailable)
    with caplog.at_level(logging.WARNING):
        response = api.get("/api/models")
    refused(response, 503, "ENGINE_UNAVAILABLE")
    assert response["Retry-After"] == str(settings.RETRY_AFTER_FALLBACK_S)
    assert any("retry_after_defaulted" in r.getMessage() for r in caplog.records)


def test_error_body_shape_is_the_same_for_every_refusal(api):
    for response in (api.get("/api/models/12345"), api.get("/api/saes/sae_missing"), api.get("/api/jobs/999")):
        data = body(response)
        assert set(data) == {"success", "data", "error"}
        assert data["success"] is False and data["data"] is None
        assert response.status_code == 404
    assert body(api.get("/api/models/12345"))["error"]["code"] == "MODEL_NOT_FOUND"
    assert body(api.get("/api/saes/sae_missing"))["error"]["code"] == "SAE_NOT_FOUND"
    assert body(api.get("/api/jobs/999"))["error"]["code"] == "JOB_NOT_FOUND"
