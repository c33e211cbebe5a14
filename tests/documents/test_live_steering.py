"""Live steering through /api/saes/steering*: the values /v1 requests without steering of
their own run with, one attachment at a time, stored per attachment in the database."""

from __future__ import annotations

import pytest

from registry.models import Attachment
from steering.models import LiveSteering
from tests.documents.conftest import ok, refused

pytestmark = pytest.mark.django_db


def _row(sae):
    return LiveSteering.objects.get(attachment__sae_id=sae.id)


def test_set_get_remove_clear(api, relu, published, django_capture_on_commit_callbacks):
    empty = ok(api.get("/api/saes/steering"))
    assert empty == {
        "sae_id": relu.id,
        "layer": 1,
        "enabled": False,
        "values": {},
        "controls": [],
        "active_count": 0,
        "source": "manual",
    }
    with django_capture_on_commit_callbacks(execute=True):
        state = ok(api.post("/api/saes/steering", {"feature_idx": 12, "value": 40}, format="json"))
    assert state["enabled"] is True and state["values"] == {"12": 40.0}
    row = _row(relu)
    assert (row.enabled, row.values, row.attachment.layer) == (True, {"12": 40.0}, 1)
    assert published[-1] == (
        "steering:update",
        {
            "sae_id": relu.id,
            "layer": 1,
            "enabled": True,
            "values": {"12": 40.0},
            "controls": [],
            "active_count": 1,
            "source": "manual",
            "reason": "set",
        },
    )

    batch = ok(api.post("/api/saes/steering/batch", {"steering": {"3": -15, "200": 8.5}}, format="json"))
    assert batch["values"] == {"3": -15.0, "12": 40.0, "200": 8.5}
    assert ok(api.get("/api/saes/steering"))["active_count"] == 3

    ok(api.post("/api/saes/steering/disable"))
    assert _row(relu).enabled is False and _row(relu).values  # values kept
    assert ok(api.get("/api/saes/steering"))["enabled"] is False
    assert ok(api.post("/api/saes/steering/enable"))["enabled"] is True

    one = ok(api.delete("/api/saes/steering/12"))
    assert one["values"] == {"3": -15.0, "200": 8.5} and one["enabled"] is True
    ok(api.delete("/api/saes/steering/3"))
    last = ok(api.delete("/api/saes/steering/200"))
    # removing the last value disables: what is reported is what runs
    assert last["values"] == {} and last["enabled"] is False
    assert _row(relu).enabled is False

    ok(api.post("/api/saes/steering", {"feature_idx": 1, "value": 2}, format="json"))
    cleared = ok(api.delete("/api/saes/steering"))
    assert cleared["values"] == {} and cleared["enabled"] is False
    assert (_row(relu).values, _row(relu).enabled) == ({}, False)
    # enabling with nothing to apply stays disabled
    assert ok(api.post("/api/saes/steering/enable"))["enabled"] is False


def test_values_and_indices_are_checked(api, relu):
    refused(api.post("/api/saes/steering", {"feature_idx": 1, "value": 200.5}, format="json"), 422, "VALIDATION_ERROR")
    refused(api.post("/api/saes/steering", {"feature_idx": 1, "value": -201}, format="json"), 422, "VALIDATION_ERROR")
    ok(api.post("/api/saes/steering", {"feature_idx": 1, "value": -200}, format="json"))
    error = refused(
        api.post("/api/saes/steering", {"feature_idx": 256, "value": 1}, format="json"), 400, "INVALID_FEATURE_INDEX"
    )
    assert error["details"]["d_sae"] == 256 and error["details"]["feature_idx"] == 256
    # a batch is all or nothing: one bad index or value and nothing changes
    refused(
        api.post("/api/saes/steering/batch", {"steering": {"2": 5, "999": 5}}, format="json"),
        400,
        "INVALID_FEATURE_INDEX",
    )
    error = refused(
        api.post("/api/saes/steering/batch", {"steering": {"2": 5, "x": 5, "4": 300}}, format="json"),
        422,
        "VALIDATION_ERROR",
    )
    assert set(error["details"]["invalid_keys"]) == {"x", "4"}
    too_many = {str(i): 1.0 for i in range(1001)}
    refused(api.post("/api/saes/steering/batch", {"steering": too_many}, format="json"), 422, "VALIDATION_ERROR")
    assert _row(relu).values == {"1": -200.0}
    full = {str(i): 1.0 for i in range(256)}
    assert ok(api.post("/api/saes/steering/batch", {"steering": full}, format="json"))["active_count"] == 256


def test_booleans_and_strings_are_not_numbers(api, relu):
    """A JSON body says a number with a number: ``true`` is not 1 and ``"5"`` is not 5."""
    for sent in (
        {"feature_idx": 1, "value": True},
        {"feature_idx": 1, "value": "5"},
        {"feature_idx": "1", "value": 5},
        {"feature_idx": True, "value": 5},
        {"feature_idx": 1, "mode": "clamp", "value": True},
        {"feature_idx": 1, "mode": "clamp", "value": 2, "condition": {"feature": 3, "threshold": "0.5"}},
    ):
        refused(api.post("/api/saes/steering", sent, format="json"), 422, "VALIDATION_ERROR")
    for control in (
        {"index": 1, "mode": "clamp", "value": True},
        {"index": 1, "mode": "scale", "value": "2"},
        {"index": 1, "strength": False},
    ):
        refused(api.post("/api/saes/steering/batch", {"controls": [control]}, format="json"), 422, "VALIDATION_ERROR")
    assert not LiveSteering.objects.filter(attachment__sae_id=relu.id).exists()
    # numbers, integral or not, are what they always were
    ok(api.post("/api/saes/steering", {"feature_idx": 1, "value": 5}, format="json"))
    state = ok(api.post("/api/saes/steering", {"feature_idx": 2, "mode": "clamp", "value": 2.5}, format="json"))
    assert state["values"] == {"1": 5.0}
    assert state["controls"] == [{"index": 2, "mode": "clamp", "value": 2.5}]


def test_the_attachment_is_named_or_the_only_one(api, llama):
    refused(api.post("/api/saes/steering", {"feature_idx": 1, "value": 2}, format="json"), 400, "SAE_NOT_ATTACHED")
    relu = llama.attach("tiny-llama-L1-relu", 1)
    topk = llama.attach("tiny-llama-L2-topk", 2)
    error = refused(api.post("/api/saes/steering", {"feature_idx": 1, "value": 2}, format="json"), 400, "AMBIGUOUS_SAE")
    assert sorted(error["details"]["choices"]) == sorted([f"{relu.id}@1", f"{topk.id}@2"])
    refused(api.get("/api/saes/steering"), 400, "AMBIGUOUS_SAE")
    ok(api.post("/api/saes/steering", {"feature_idx": 1, "value": 2, "sae_id": topk.id}, format="json"))
    ok(api.post("/api/saes/steering/batch?layer=1", {"steering": {"7": 3}}, format="json"))
    assert ok(api.get(f"/api/saes/steering?sae_id={topk.id}"))["values"] == {"1": 2.0}
    assert ok(api.get("/api/saes/steering?layer=1"))["values"] == {"7": 3.0}
    refused(api.get("/api/saes/steering?layer=3"), 400, "SAE_NOT_ATTACHED")


def test_detach_clears_the_attachments_live_steering(api, relu, published, django_capture_on_commit_callbacks):
    ok(api.post("/api/saes/steering", {"feature_idx": 5, "value": 9}, format="json"))
    with django_capture_on_commit_callbacks(execute=True):
        ok(api.post(f"/api/saes/{relu.id}/detach", {}, format="json"))
    assert not LiveSteering.objects.exists()
    assert (
        "steering:update",
        {
            "sae_id": relu.id,
            "layer": 1,
            "enabled": False,
            "values": {},
            "controls": [],
            "active_count": 0,
            "source": "manual",
            "reason": "detach",
        },
    ) in published
    # attached again, it starts clean
    ok(api.post(f"/api/saes/{relu.id}/attach", {"layer": 1}, format="json"))
    assert ok(api.get("/api/saes/steering"))["values"] == {}
    status = ok(api.get("/api/saes/attachment"))
    assert status["steering_enabled"] is False
    ok(api.post("/api/saes/steering", {"feature_idx": 5, "value": 9}, format="json"))
    assert ok(api.get("/api/saes/attachment"))["steering_enabled"] is True
    # the SAE list's attachment block says the same
    assert ok(api.get("/api/saes"))["attachment"]["steering_enabled"] is True
    ok(api.post("/api/monitoring/configure", {"enabled": True, "sae_id": relu.id, "layer": 1}, format="json"))
    assert ok(api.get("/api/saes"))["attachment"]["monitoring_enabled"] is True
    assert ok(api.get("/api/saes/attachment"))["monitoring_enabled"] is True


@pytest.mark.django_db(transaction=True)
def test_controls_set_elsewhere_reach_this_process_copy(settings, relu):
    """Distributed: a change another web worker makes (the row alone, nothing invalidated
    here) reaches this process's copy of the live steering, controls included, through
    the background refresher, so a request without steering of its own runs them."""
    import time

    from core.process_copy import refresher
    from gpu_engine.api.protocol import FeatureControl
    from steering.live import live_copy

    settings.EMBEDDED = False
    settings.MILLM_PROCESS_COPY_REFRESH = True
    live_copy.read()
    assert live_copy.fresh() == []
    attachment = Attachment.objects.get(sae_id=relu.id, layer=1)
    LiveSteering.objects.create(
        attachment=attachment, enabled=True, values={"3": 2.0}, controls=[{"index": 9, "mode": "ablate"}]
    )
    deadline = time.monotonic() + live_copy.fresh_s + 2
    seen = None
    while time.monotonic() < deadline:
        seen = live_copy.fresh()
        assert seen is not None
        if seen:
            break
        time.sleep(0.05)
    settings.MILLM_PROCESS_COPY_REFRESH = False
    assert refresher.join(5)
    settings.EMBEDDED = True
    assert seen is not None and len(seen) == 1
    assert (seen[0].features, seen[0].controls) == ({3: 2.0}, [FeatureControl(9, mode="ablate")])


def test_live_steering_and_monitoring_a_backend_cannot_run_are_refused_when_set(api, relu, llama, monkeypatch):
    """A backend reporting per_request_steering and per_request_monitoring off (a stand-in
    status: every backend today runs both): live steering or monitoring accepted then would
    fail every later /v1 request with a field its client never sent, so they are refused
    when set, and nothing is stored."""
    import msgspec

    real = llama.engine.status

    def graphs_on():
        status = real()
        caps = {
            **status.batching.get("capabilities", {}),
            "per_request_steering": False,
            "per_request_monitoring": False,
        }
        return msgspec.structs.replace(status, batching={**status.batching, "capabilities": caps})

    monkeypatch.setattr(llama.engine, "status", graphs_on)
    error = refused(
        api.post("/api/saes/steering", {"feature_idx": 3, "value": 5}, format="json"), 422, "VALIDATION_ERROR"
    )
    assert error["details"]["param"] == "steering"
    assert not LiveSteering.objects.filter(enabled=True).exists()
    error = refused(api.post("/api/monitoring/configure", {"enabled": True}, format="json"), 422, "VALIDATION_ERROR")
    assert error["details"]["capability"] == "per_request_monitoring"
    refused(api.post("/api/monitoring/enable", {"enabled": True}, format="json"), 422, "VALIDATION_ERROR")
    # turning things off is always allowed
    ok(api.post("/api/monitoring/enable", {"enabled": False}, format="json"))
    ok(api.delete("/api/saes/steering"))
    monkeypatch.setattr(llama.engine, "status", real)
    assert ok(api.post("/api/saes/steering", {"feature_idx": 3, "value": 5}, format="json"))["enabled"] is True
