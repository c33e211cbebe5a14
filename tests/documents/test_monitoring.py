"""/api/monitoring: configuration, the entry /v1 requests carry, the bounded history
(newest first, by request id), statistics over it, the rate-capped events."""

from __future__ import annotations

import math

import pytest

from gpu_engine.api.protocol import ActivationRecord as EngineRecord
from gpu_engine.api.protocol import FeatureActivation, FinishEvent, MonitorEntry, MonitorSpec, Usage
from core import events
from monitoring import services
from monitoring.models import ActivationRecord, MonitoringConfig
from tests.documents.conftest import ok, refused
from tests.documents.helpers import engine_attachments

pytestmark = pytest.mark.django_db


def rec(sae_id, position, values: dict[int, float], read_point="pre_steering", layer=1):
    pairs = [FeatureActivation(i, v) for i, v in values.items()]
    top = sorted((p for p in pairs if p.activation > 0), key=lambda p: -p.activation)
    return EngineRecord(
        sae_id=sae_id,
        layer=layer,
        read_point=read_point,
        position=position,
        token_index=None,
        top_k=top,
        features=pairs,
    )


def test_configure_enable_and_the_request_entry(api, llama, published, django_capture_on_commit_callbacks):
    refused(api.post("/api/monitoring/configure", {"features": [1]}, format="json"), 400, "SAE_NOT_ATTACHED")
    relu = llama.attach("tiny-llama-L1-relu", 1)
    refused(api.post("/api/monitoring/configure", {"features": [1, 256]}, format="json"), 400, "INVALID_FEATURE_INDEX")
    refused(api.post("/api/monitoring/configure", {"top_k": 1001}, format="json"), 422, "VALIDATION_ERROR")
    with django_capture_on_commit_callbacks(execute=True):
        state = ok(
            api.post("/api/monitoring/configure", {"features": [5, 3], "top_k": 4, "history_size": 3}, format="json")
        )
    assert state["enabled"] is True and state["monitored_features"] == [3, 5]
    assert (state["sae_id"], state["layer"], state["read_point"]) == (relu.id, 1, "pre_steering")
    config = MonitoringConfig.objects.get()
    assert (config.enabled, config.features, config.top_k, config.history_size) == (True, [3, 5], 4, 3)
    assert published[-1][0] == "monitoring:state"
    entry = services.monitoring_request_entry(attachments=engine_attachments())
    assert entry == MonitorEntry(
        sae_id=relu.id, layer=1, top_k=4, features=[3, 5], read_point="pre_steering", positions="last", stream=False
    )
    # what /v1 uses without reading the database: this process's copy, which the read
    # above refreshed and which a change made here drops at once
    cached = services.monitoring_request_config()
    assert cached is not None and (cached.enabled, cached.features) == (True, [3, 5])
    assert services.monitoring_request_entry(attachments=engine_attachments(), config=cached) == entry
    with django_capture_on_commit_callbacks(execute=True):
        ok(api.post("/api/monitoring/enable", {"enabled": False}, format="json"))
    assert services.monitoring_request_config() is None
    assert services.monitoring_request_entry(attachments=engine_attachments()) is None
    assert MonitoringConfig.objects.get().features == [3, 5]  # kept while disabled
    assert ok(api.get("/api/monitoring"))["enabled"] is False
    # the alias of the original
    assert ok(api.post("/api/saes/monitoring", {"features": None}, format="json"))["monitored_features"] is None
    assert services.monitoring_request_entry(attachments=engine_attachments()).features == []


def test_merge_keeps_the_requests_own_records_apart():
    own = MonitorSpec([MonitorEntry(sae_id="sae_a", layer=1, top_k=2)])  # post_steering
    entry = MonitorEntry(sae_id="sae_a", layer=1, top_k=3, read_point="pre_steering")
    merged, kept = services.monitoring_merge(own, entry)
    assert kept is entry and len(merged.entries) == 2
    clash = MonitorSpec([MonitorEntry(sae_id="sae_a", layer=1, top_k=2, read_point="pre_steering")])
    assert services.monitoring_merge(clash, entry) == (clash, None)
    finish = FinishEvent(
        request_id="r",
        finish_reason="stop",
        text="",
        token_ids=[],
        prompt_token_ids=[],
        usage=Usage(1, 1, 2),
        activations=[rec("sae_a", 3, {1: 1.0}), rec("sae_a", 3, {1: 2.0}, read_point="post_steering")],
    )
    taken = services.monitoring_take_records(entry=entry, finish=finish)
    assert [r.read_point for r in taken] == ["pre_steering"]
    assert [r.read_point for r in finish.activations] == ["post_steering"]


def test_a_configure_changes_only_the_fields_it_names(api, llama):
    """Turning one dial must not reset the others to their defaults (which pruned the
    history a user had sized); another SAE starts from all features."""
    relu = llama.attach("tiny-llama-L1-relu", 1)
    ok(
        api.post(
            "/api/monitoring/configure",
            {"features": [1, 2], "history_size": 200, "top_k": 5, "positions": "all"},
            format="json",
        )
    )
    entry = services.monitoring_request_entry(attachments=engine_attachments())
    services.monitoring_record(
        request_id="chatcmpl-a", entry=entry, records=[rec(relu.id, p, {1: 1.0, 2: 0.0}) for p in range(150)]
    )
    state = ok(api.post("/api/monitoring/configure", {"features": [3]}, format="json"))
    assert (state["monitored_features"], state["history_size"], state["top_k"], state["positions"]) == (
        [3],
        200,
        5,
        "all",
    )
    assert ActivationRecord.objects.count() == 150  # nothing pruned
    state = ok(api.post("/api/monitoring/configure", {"top_k": 7}, format="json"))
    assert (state["monitored_features"], state["top_k"]) == ([3], 7)
    topk = llama.attach("tiny-llama-L2-topk", 2)
    state = ok(api.post("/api/monitoring/configure", {"sae_id": topk.id, "layer": 2}, format="json"))
    assert (state["sae_id"], state["monitored_features"], state["history_size"]) == (topk.id, None, 200)


def test_history_is_bounded_newest_first_and_filtered(api, relu):
    ok(api.post("/api/monitoring/configure", {"features": [1, 2], "history_size": 4, "top_k": 2}, format="json"))
    entry = services.monitoring_request_entry(attachments=engine_attachments())
    services.monitoring_record(
        request_id="chatcmpl-a",
        entry=entry,
        records=[rec(relu.id, 5, {1: 0.5, 2: 0.0}), rec(relu.id, 6, {1: 1.5, 2: 2.0})],
    )
    services.monitoring_record(
        request_id="chatcmpl-b",
        entry=entry,
        records=[
            rec(relu.id, 7, {1: 0.0, 2: 4.0}),
            rec(relu.id, 8, {1: 2.5, 2: 0.0}),
            rec(relu.id, 9, {1: 3.5, 2: 1.0}),
        ],
    )
    assert ActivationRecord.objects.count() == 4  # the oldest went
    history = ok(api.get("/api/monitoring/history"))
    assert history["total"] == 4
    assert [(r["request_id"], r["token_position"]) for r in history["records"]] == [
        ("chatcmpl-b", 9),
        ("chatcmpl-b", 8),
        ("chatcmpl-b", 7),
        ("chatcmpl-a", 6),
    ]
    first = history["records"][0]
    assert set(first) >= {"timestamp", "request_id", "token_position", "activations", "top_k"}
    assert first["activations"] == [{"feature_index": 1, "activation": 3.5}, {"feature_index": 2, "activation": 1.0}]
    assert first["top_k"] == [{"feature_index": 1, "activation": 3.5}, {"feature_index": 2, "activation": 1.0}]
    only_a = ok(api.get("/api/monitoring/history?request_id=chatcmpl-a"))
    assert only_a["total"] == 1 and only_a["records"][0]["token_position"] == 6
    assert ok(api.get("/api/monitoring/history?limit=2"))["records"][1]["token_position"] == 8

    # statistics over those four records, computed by hand
    stats = {f["feature_idx"]: f for f in ok(api.get("/api/monitoring/statistics"))["features"]}
    f1 = [1.5, 0.0, 2.5, 3.5]
    mean = sum(f1) / 4
    assert stats[1]["count"] == 4 and stats[1]["mean"] == pytest.approx(mean)
    assert stats[1]["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in f1) / 4))
    assert (stats[1]["min"], stats[1]["max"], stats[1]["active_ratio"]) == (0.0, 3.5, 0.75)
    assert (stats[2]["mean"], stats[2]["max"], stats[2]["active_ratio"]) == (pytest.approx(7 / 4), 4.0, 0.75)
    only = ok(api.get("/api/monitoring/statistics?features=2,9"))
    assert [f["feature_idx"] for f in only["features"]] == [2, 9]
    assert only["features"][1]["count"] == 0 and only["total_activations"] == 4
    top = ok(api.post("/api/monitoring/statistics/top", {"k": 1, "metric": "max"}, format="json"))
    assert [f["feature_idx"] for f in top["features"]] == [2]
    top = ok(api.post("/api/monitoring/statistics/top", {"k": 2, "metric": "mean"}, format="json"))
    assert [f["feature_idx"] for f in top["features"]] == [1, 2]  # 1.875 > 1.75
    refused(api.post("/api/monitoring/statistics/top", {"metric": "median"}, format="json"), 422, "VALIDATION_ERROR")

    reset = ok(api.delete("/api/monitoring/statistics"))
    assert reset["statistics_since"] is not None
    assert ok(api.get("/api/monitoring/statistics"))["total_activations"] == 0
    assert ok(api.delete("/api/monitoring/history"))["deleted"] == 4
    assert not ActivationRecord.objects.exists()


def test_activation_events_are_rate_capped(relu, published, monkeypatch):
    config = MonitoringConfig.objects.create(pk=1, enabled=True, top_k=2)
    entry = MonitorEntry(sae_id=relu.id, layer=1, top_k=config.top_k, read_point="pre_steering")
    clock = [100.0]
    monkeypatch.setattr(services.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(services, "event_cap", services._RateCap(services.EVENTS_PER_SECOND))
    for i in range(25):  # 25 generations within 0.5 s
        clock[0] += 0.02
        services.monitoring_record(request_id=f"r{i}", entry=entry, records=[rec(relu.id, i, {1: 1.0})])
    sent = [d for n, d in published if n == "monitoring:activation"]
    # 10 a second: a second's worth at once, then what 0.5 s refills (not all 25)
    assert 10 <= len(sent) <= 10 + 5
    assert [d["request_id"] for d in sent[:10]] == [f"r{i}" for i in range(10)]
    assert ActivationRecord.objects.count() == 25  # the history keeps everything
    assert set(sent[0]) == {
        "timestamp",
        "request_id",
        "sae_id",
        "layer",
        "token_position",
        "top_k",
        "records",
        events.OWNER_FIELD,
    }
    # the socket sends it to its owner's (here the keyless anonymous owner's) sockets only
    assert sent[0][events.OWNER_FIELD] == "anonymous"
    clock[0] += 1.0
    services.monitoring_record(request_id="later", entry=entry, records=[rec(relu.id, 1, {1: 1.0})])
    assert [d for n, d in published if n == "monitoring:activation"][-1]["request_id"] == "later"


@pytest.mark.django_db(transaction=True)
def test_a_change_made_elsewhere_reaches_the_copy_in_the_background(settings):
    """With several processes (distributed), what another web worker changes reaches this
    process's copy within its freshness bound, read by the background refresher: a
    request keeps finding the copy fresh and never reads the database itself."""
    import time

    from core.process_copy import refresher

    settings.EMBEDDED = False
    settings.MILLM_PROCESS_COPY_REFRESH = True
    copy = services.request_config
    copy.read()
    assert copy.fresh() is not None and copy.fresh().enabled is False
    # another process's change: the row alone, nothing in this process invalidated
    MonitoringConfig.objects.update_or_create(pk=1, defaults={"enabled": True, "top_k": 7})
    deadline = time.monotonic() + copy.fresh_s + 2
    seen = None
    while time.monotonic() < deadline:
        seen = copy.fresh()
        assert seen is not None  # kept fresh in the background all along
        if seen.enabled:
            break
        time.sleep(0.05)
    settings.MILLM_PROCESS_COPY_REFRESH = False
    assert refresher.join(5)
    # embedded, no other process changes it: the copy is this process's word until it
    # drops it itself
    settings.EMBEDDED = True
    MonitoringConfig.objects.filter(pk=1).update(top_k=9)
    time.sleep(copy.fresh_s + 0.1)
    assert copy.fresh().top_k == 7  # stopped, its connection closed, before the database goes
    assert seen is not None and (seen.enabled, seen.top_k) == (True, 7)
