"""The audit log (docs/security.md, "Audit log"): each change of state asked through the
real /api (and the admin site) leaves one entry naming who asked (the key's label, the
admin user, ``anonymous`` with keys off), the action, its target, its parameters (never a
secret) and its result (ok, the refusal's code, or pending until the job ends);
``GET /api/audit`` is for admin keys only, filters and pages within bounds; the sweeper
prunes entries past AUDIT_RETENTION_DAYS."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEntry
from orchestration import tasks
from registry import tasks as registry_tasks
from tests.api.conftest import MODEL_REPO, ok, refused, run_job

pytestmark = pytest.mark.django_db

ADMIN = "Bearer adm-secret-1"
ALICE = "Bearer inf-secret-a"
BOB = "Bearer inf-secret-b"


@pytest.fixture
def keys(settings):
    settings.MILLM_ADMIN_API_KEYS = ("root:adm-secret-1",)
    settings.MILLM_API_KEYS = ("alice:inf-secret-a", "bob:inf-secret-b")


def _entries(**filters) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(**filters).order_by("id"))


def _one(**filters) -> AuditEntry:
    rows = _entries(**filters)
    assert len(rows) == 1, [(r.action, r.actor, r.result) for r in AuditEntry.objects.order_by("id")]
    return rows[0]


def test_load_attach_steer_detach_unload_are_recorded_with_the_admin_keys_label(
    api, keys, engine_client, tiny_llama, llama_saes
):
    sae = llama_saes["tiny-llama-L1-relu"]
    data = ok(api.post(f"/api/models/{tiny_llama.id}/load", HTTP_AUTHORIZATION=ADMIN), 202)
    entry = _one(action="model.load")
    assert (entry.actor, entry.actor_kind, entry.target_kind, entry.target_id, entry.target_name) == (
        "root",
        "admin_key",
        "model",
        str(tiny_llama.id),
        "tiny-llama",
    )
    assert (entry.result, entry.job_id) == ("pending", data["job"]["id"])
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    entry.refresh_from_db()
    assert entry.result == "ok" and entry.finished_at is not None
    assert AuditEntry.objects.filter(action="model.load").count() == 1  # the job finished it, no second entry

    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json", HTTP_AUTHORIZATION=ADMIN))
    entry = _one(action="sae.attach")
    assert (entry.actor, entry.target_kind, entry.target_id, entry.params, entry.result) == (
        "root",
        "sae",
        sae.id,
        {"layer": 1},
        "ok",
    )
    # a refusal records its error code
    refused(
        api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json", HTTP_AUTHORIZATION=ADMIN),
        409,
        "SAE_ALREADY_ATTACHED",
    )
    assert [e.result for e in _entries(action="sae.attach")] == ["ok", "SAE_ALREADY_ATTACHED"]

    body = {"sae_id": sae.id, "layer": 1, "steering": {"3": 2.5}}
    ok(api.post("/api/saes/steering/batch", body, format="json", HTTP_AUTHORIZATION=ADMIN))
    entry = _one(action="steering.set")
    assert (entry.actor, entry.target_kind, entry.target_id, entry.result) == (
        "root",
        "attachment",
        f"{sae.id}@1",
        "ok",
    )
    assert entry.params["values"] == {"3": 2.5}
    ok(api.post("/api/saes/steering/disable", {"sae_id": sae.id}, format="json", HTTP_AUTHORIZATION=ADMIN))
    assert _one(action="steering.enable").params == {"enabled": False}

    # a document: its creation and activation (which sets the live steering) are one entry each
    profile = {"name": "calm", "sae_id": sae.id, "layer": 1, "steering": {"5": 1.5}}
    created = ok(api.post("/api/profiles", profile, format="json", HTTP_AUTHORIZATION=ADMIN), 201)
    assert (_one(action="profile.create").target_id, _one(action="profile.create").target_name) == (
        str(created["id"]),
        "calm",
    )
    ok(api.post(f"/api/profiles/{created['id']}/activate", {}, format="json", HTTP_AUTHORIZATION=ADMIN))
    entry = _one(action="profile.activate")
    assert (entry.actor, entry.target_kind, entry.target_id, entry.result) == (
        "root",
        "profile",
        str(created["id"]),
        "ok",
    )
    assert len(_entries(action="steering.set")) == 1  # the activation's own steering is not a second entry
    ok(api.post(f"/api/profiles/{created['id']}/deactivate", HTTP_AUTHORIZATION=ADMIN))
    assert _one(action="profile.deactivate").result == "ok"
    ok(api.delete(f"/api/profiles/{created['id']}", HTTP_AUTHORIZATION=ADMIN))
    assert (_one(action="profile.delete").target_id, _one(action="profile.delete").target_name) == (
        str(created["id"]),
        "calm",
    )

    refused(api.post(f"/api/models/{tiny_llama.id}/unload", HTTP_AUTHORIZATION=ADMIN), 409, "MODEL_LOCKED")
    assert _one(action="model.unload").result == "MODEL_LOCKED"
    ok(api.post(f"/api/saes/{sae.id}/detach", {}, format="json", HTTP_AUTHORIZATION=ADMIN))
    assert (_one(action="sae.detach").actor, _one(action="sae.detach").result) == ("root", "ok")
    ok(api.post(f"/api/models/{tiny_llama.id}/unlock", HTTP_AUTHORIZATION=ADMIN))
    unload = ok(api.post(f"/api/models/{tiny_llama.id}/unload", HTTP_AUTHORIZATION=ADMIN), 202)
    pending = _entries(action="model.unload")[-1]
    assert (pending.result, pending.job_id) == ("pending", unload["job"]["id"])
    assert tasks.model_unload_task(unload["job"]["id"]) == "succeeded"
    pending.refresh_from_db()
    assert pending.result == "ok"


def test_an_inference_keys_own_changes_are_recorded_under_its_label(api, keys):
    ok(api.delete("/api/monitoring/history", HTTP_AUTHORIZATION=ALICE))
    entry = _one(action="monitoring.history_clear")
    assert (entry.actor, entry.actor_kind, entry.target_id, entry.result) == (
        "alice",
        "inference_key",
        "key:alice",
        "ok",
    )
    # a refused deletion records the refusal's code
    refused(api.delete("/api/captures/cap_nothere", HTTP_AUTHORIZATION=BOB), 404, "CAPTURE_NOT_FOUND")
    entry = _one(action="capture.delete")
    assert (entry.actor, entry.target_id, entry.result) == ("bob", "cap_nothere", "CAPTURE_NOT_FOUND")
    # an admin action the key may not ask for never reaches a service: refused, nothing changed
    refused(
        api.post("/api/monitoring/enable", {"enabled": True}, format="json", HTTP_AUTHORIZATION=ALICE), 403, "FORBIDDEN"
    )
    assert not _entries(action="monitoring.enable")


def test_registry_changes_and_a_download_keep_no_secret(api, keys, hub, tiny_assets):
    local = str(tiny_assets.models["tiny-llama"].path)
    body = {"source": "local", "local_path": local, "custom_name": "mine", "quantization": "FP32"}
    model = ok(api.post("/api/models", body, format="json", HTTP_AUTHORIZATION=ADMIN), 201)["model"]
    entry = _one(action="model.register")
    assert (entry.actor, entry.target_id, entry.target_name, entry.result) == ("root", str(model["id"]), "mine", "ok")
    assert entry.params["local_path"] == local
    # the same checkpoint again: refused, recorded with its code
    refused(api.post("/api/models", body, format="json", HTTP_AUTHORIZATION=ADMIN), 409, "MODEL_ALREADY_EXISTS")
    assert [e.result for e in _entries(action="model.register")] == ["ok", "MODEL_ALREADY_EXISTS"]

    # a token the hub refuses: the refusal is recorded, the token is not
    download = {"repo_id": MODEL_REPO, "quantization": "FP32", "hf_token": "hf_SuperSecretValue"}
    refused(api.post("/api/models", download, format="json", HTTP_AUTHORIZATION=ADMIN), 401, "INVALID_HF_TOKEN")
    entry = _one(action="model.download")
    assert (entry.target_name, entry.result) == (MODEL_REPO, "INVALID_HF_TOKEN")
    assert entry.params["repo_id"] == MODEL_REPO and "hf_token" not in entry.params
    assert "SuperSecret" not in json.dumps(entry.params) + entry.message
    del download["hf_token"]
    data = ok(api.post("/api/models", download, format="json", HTTP_AUTHORIZATION=ADMIN), 202)
    entry = _entries(action="model.download")[-1]
    assert (entry.target_id, entry.result, entry.job_id) == (str(data["model"]["id"]), "pending", data["job"]["id"])
    run_job(registry_tasks.model_download_task, data["job"]["id"])
    entry.refresh_from_db()
    assert entry.result == "ok" and entry.finished_at is not None

    ok(api.post(f"/api/models/{model['id']}/lock", HTTP_AUTHORIZATION=ADMIN))
    refused(api.delete(f"/api/models/{model['id']}", HTTP_AUTHORIZATION=ADMIN), 409, "MODEL_LOCKED")
    assert _one(action="model.delete").result == "MODEL_LOCKED"
    ok(api.post(f"/api/models/{model['id']}/unlock", HTTP_AUTHORIZATION=ADMIN))
    ok(api.delete(f"/api/models/{model['id']}", HTTP_AUTHORIZATION=ADMIN))
    assert [e.result for e in _entries(action="model.delete")] == ["MODEL_LOCKED", "ok"]
    assert [e.action for e in _entries(target_id=str(model["id"]))] == [
        "model.register",
        "model.lock",
        "model.delete",
        "model.unlock",
        "model.delete",
    ]
    # no entry anywhere holds a key's secret
    dumped = json.dumps([[e.actor, e.params, e.message] for e in AuditEntry.objects.all()])
    assert "adm-secret" not in dumped and "SuperSecret" not in dumped


def test_keys_off_the_actor_is_anonymous(api, tiny_llama):
    ok(api.post(f"/api/models/{tiny_llama.id}/lock"))
    entry = _one(action="model.lock")
    assert (entry.actor, entry.actor_kind, entry.target_id) == ("anonymous", "anonymous", str(tiny_llama.id))


def test_an_admin_site_action_names_the_admin_user(admin_client, tiny_llama):
    response = admin_client.post(
        "/admin/registry/model/", {"action": "lock_models", "_selected_action": [tiny_llama.id]}
    )
    assert response.status_code == 302
    entry = _one(action="model.lock")
    assert (entry.actor, entry.actor_kind, entry.result) == ("admin", "admin_user", "ok")
    # the log is read-only in the admin
    page = admin_client.get("/admin/audit/auditentry/")
    assert page.status_code == 200 and b"model.lock" in page.content
    assert admin_client.get("/admin/audit/auditentry/add/").status_code == 403
    entry_url = f"/admin/audit/auditentry/{entry.id}/delete/"
    assert admin_client.post(entry_url, {"post": "yes"}).status_code == 403
    assert AuditEntry.objects.filter(pk=entry.id).exists()


def test_outside_a_request_the_actor_is_system(tiny_llama):
    from registry import services

    services.model_lock(model=tiny_llama)
    assert (_one(action="model.lock").actor, _one(action="model.lock").actor_kind) == ("system", "system")


def test_a_failing_record_never_breaks_the_action(api, tiny_llama, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("the audit table is gone")

    monkeypatch.setattr(AuditEntry, "save", broken)
    ok(api.post(f"/api/models/{tiny_llama.id}/lock"))
    tiny_llama.refresh_from_db()
    assert tiny_llama.locked


def _target(entry: AuditEntry) -> tuple:
    return (entry.actor, entry.target_kind, entry.target_id, entry.target_name, entry.result)


def test_runs_started_and_cancelled_are_recorded(api, keys, settings, tmp_path, engine_client, tiny_llama, llama_saes):
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    sae = llama_saes["tiny-llama-L1-relu"]
    data = ok(api.post(f"/api/models/{tiny_llama.id}/load", HTTP_AUTHORIZATION=ADMIN), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json", HTTP_AUTHORIZATION=ADMIN))

    # a dashboard run: start, cancel, a refused cancel
    body = {"corpus": "sample", "token_budget": 64, "context_tokens": 16}
    run = ok(api.post(f"/api/saes/{sae.id}/dashboards", body, format="json", HTTP_AUTHORIZATION=ALICE), 202)["run"]
    entry = _one(action="dashboard.start")
    assert _target(entry) == ("alice", "dashboard_run", run["id"], sae.id, "ok")
    assert (entry.params["budget"], entry.params["context"], entry.params["corpus"]) == (64, 16, "sample")
    ok(api.post(f"/api/dashboards/{run['id']}/cancel", HTTP_AUTHORIZATION=ALICE))
    refused(api.post(f"/api/dashboards/{run['id']}/cancel", HTTP_AUTHORIZATION=BOB), 404, "DASHBOARD_NOT_FOUND")
    assert [_target(e) for e in _entries(action="dashboard.cancel")] == [
        ("alice", "dashboard_run", run["id"], sae.id, "ok"),
        ("bob", "dashboard_run", run["id"], "", "DASHBOARD_NOT_FOUND"),
    ]
    # a refused start names what it asked for
    other = llama_saes["tiny-llama-L3-relu"]
    answer = api.post(f"/api/saes/{other.id}/dashboards", body, format="json", HTTP_AUTHORIZATION=ALICE)
    assert answer.status_code == 409
    assert _target(_entries(action="dashboard.start")[-1]) == (
        "alice",
        "dashboard_run",
        "",
        other.id,
        answer.json()["error"]["code"],
    )

    # an experiment: sweep start and cancel; its prompts are not kept
    sweep = {"prompts": ["a private prompt"], "variants": [{"sae_id": sae.id, "index": 3}], "strengths": [0.0, 2.0]}
    run = ok(api.post("/api/experiments/sweep", sweep, format="json", HTTP_AUTHORIZATION=ALICE), 202)["run"]
    entry = _one(action="experiment.sweep")
    assert _target(entry) == ("alice", "experiment_run", run["id"], "sweep", "ok")
    assert entry.params["variants"] == [{"sae_id": sae.id, "index": 3}] and "a private prompt" not in json.dumps(
        entry.params
    )
    ok(api.post(f"/api/experiments/{run['id']}/cancel", HTTP_AUTHORIZATION=ALICE))
    assert _target(_one(action="experiment.cancel")) == ("alice", "experiment_run", run["id"], "sweep", "ok")
    # refusals: a calibration saving a profile needs an admin key; a fidelity run's SAE is attached
    calibrate = {"prompts": ["p"], "variant": {"sae_id": sae.id, "index": 3}, "target_kl": 0.1, "save_profile": "x"}
    refused(
        api.post("/api/experiments/calibrate", calibrate, format="json", HTTP_AUTHORIZATION=ALICE), 403, "FORBIDDEN"
    )
    entry = _one(action="experiment.calibrate")
    assert (entry.actor, entry.result, entry.params["save_profile"]) == ("alice", "FORBIDDEN", "x")
    fidelity = {"sae_id": "sae_nothere", "token_budget": 64}
    answer = api.post("/api/experiments/fidelity", fidelity, format="json", HTTP_AUTHORIZATION=ALICE)
    assert answer.status_code >= 400
    entry = _one(action="experiment.fidelity")
    assert (entry.actor, entry.result, entry.params["sae_id"]) == (
        "alice",
        answer.json()["error"]["code"],
        "sae_nothere",
    )


def test_a_job_cancel_is_recorded_and_its_refusal_is_lost_with_the_routes_rollback(
    api, keys, engine_client, tiny_llama
):
    load = ok(api.post(f"/api/models/{tiny_llama.id}/load", HTTP_AUTHORIZATION=ADMIN), 202)["job"]
    ok(api.post(f"/api/jobs/{load['id']}/cancel", HTTP_AUTHORIZATION=ADMIN))
    assert _target(_one(action="job.cancel")) == ("root", "job", str(load["id"]), "model_load", "ok")
    assert _one(action="model.load").result == "CANCELLED"
    # the documented limitation (docs/security.md, "Audit log"): the route's own atomic
    # block rolls the refusal back, its entry with it
    refused(api.post(f"/api/jobs/{load['id']}/cancel", HTTP_AUTHORIZATION=ADMIN), 409, "JOB_ALREADY_FINISHED")
    assert [e.result for e in _entries(action="job.cancel")] == ["ok"]


def test_explanation_changes_are_recorded(api, keys, settings, llama_saes):
    settings.EXPLAINER_BASE_URL = ""
    sae = llama_saes["tiny-llama-L1-relu"]
    row = ok(
        api.post(
            f"/api/saes/{sae.id}/explanations",
            {"index": 3, "description": "cats"},
            format="json",
            HTTP_AUTHORIZATION=ADMIN,
        ),
        201,
    )
    assert _target(_one(action="explanation.create")) == ("root", "explanation", str(row["id"]), sae.id, "ok")
    rows = [{"index": 4, "description": "dogs"}]
    imported = ok(api.post(f"/api/saes/{sae.id}/explanations/import", rows, format="json", HTTP_AUTHORIZATION=ADMIN))
    assert imported["imported"] == 1
    entry = _one(action="explanation.import")
    assert (entry.actor, entry.target_kind, entry.target_id, entry.result) == ("root", "sae", sae.id, "ok")
    ok(api.delete(f"/api/saes/{sae.id}/explanations/{row['id']}", HTTP_AUTHORIZATION=ADMIN))
    refused(
        api.delete(f"/api/saes/{sae.id}/explanations/{row['id']}", HTTP_AUTHORIZATION=ADMIN),
        404,
        "EXPLANATION_NOT_FOUND",
    )
    assert [_target(e) for e in _entries(action="explanation.delete")] == [
        ("root", "explanation", str(row["id"]), sae.id, "ok"),
        ("root", "explanation", str(row["id"]), sae.id, "EXPLANATION_NOT_FOUND"),
    ]
    refused(
        api.post(
            f"/api/saes/{sae.id}/explanations/generate", {"features": [3]}, format="json", HTTP_AUTHORIZATION=ADMIN
        ),
        409,
        "EXPLAINER_NOT_CONFIGURED",
    )
    entry = _one(action="explanation.generate")
    assert (entry.target_id, entry.params, entry.result) == (
        sae.id,
        {"features": [3], "score": False},
        "EXPLAINER_NOT_CONFIGURED",
    )
    # an inference key may not write: refused before any service, nothing recorded
    refused(api.delete(f"/api/saes/{sae.id}/explanations/1", HTTP_AUTHORIZATION=ALICE), 403, "FORBIDDEN")
    assert len(_entries(action="explanation.delete")) == 2


def test_key_limit_rows_changed_in_the_admin_name_the_admin_user(admin_client):
    from inference.models import KeyLimit

    form = {"label": "alice", "rpm": "60", "tpm": "", "concurrent": ""}
    assert admin_client.post("/admin/inference/keylimit/add/", form).status_code == 302
    row = KeyLimit.objects.get(label="alice")
    entry = _one(action="key_limit.create")
    assert (entry.actor, entry.actor_kind) == ("admin", "admin_user")
    assert (entry.target_kind, entry.target_id, entry.target_name, entry.result) == (
        "key_limit",
        str(row.id),
        "alice",
        "ok",
    )
    assert entry.params == {"rpm": 60, "tpm": None, "concurrent": None}
    form = {"label": "alice", "rpm": "", "tpm": "5000", "concurrent": "2"}
    assert admin_client.post(f"/admin/inference/keylimit/{row.id}/change/", form).status_code == 302
    entry = _one(action="key_limit.update")
    assert (entry.actor, entry.target_id, entry.params) == (
        "admin",
        str(row.id),
        {"rpm": None, "tpm": 5000, "concurrent": 2},
    )
    assert admin_client.post(f"/admin/inference/keylimit/{row.id}/delete/", {"post": "yes"}).status_code == 302
    other = KeyLimit.objects.create(label="*", rpm=5)
    bulk = {"action": "delete_selected", "_selected_action": [other.id], "post": "yes"}
    assert admin_client.post("/admin/inference/keylimit/", bulk).status_code == 302
    assert not KeyLimit.objects.exists()
    assert [(e.actor, e.target_id, e.target_name) for e in _entries(action="key_limit.delete")] == [
        ("admin", str(row.id), "alice"),
        ("admin", str(other.id), "*"),
    ]


# --- GET /api/audit -------------------------------------------------------------------


def _seed() -> list[AuditEntry]:
    now = timezone.now()
    rows = [
        AuditEntry(actor="root", actor_kind="admin_key", action="model.load", target_kind="model", target_id="1",
                   target_name="tiny", created_at=now - timedelta(hours=3)),
        AuditEntry(actor="alice", actor_kind="inference_key", action="capture.delete", target_kind="capture",
                   target_id="cap_1", result="CAPTURE_NOT_FOUND", created_at=now - timedelta(hours=2)),
        AuditEntry(actor="root", actor_kind="admin_key", action="model.unload", target_kind="model", target_id="1",
                   target_name="tiny", created_at=now - timedelta(hours=1)),
    ]  # fmt: skip
    return AuditEntry.objects.bulk_create(rows)


def test_reading_the_log_needs_an_admin_key(api, keys):
    _seed()
    refused(api.get("/api/audit", HTTP_AUTHORIZATION=ALICE), 403, "FORBIDDEN")
    refused(api.get("/api/audit"), 401, "UNAUTHORIZED")
    refused(api.get("/api/audit", HTTP_AUTHORIZATION="Bearer nope"), 401, "UNAUTHORIZED")
    data = ok(api.get("/api/audit", HTTP_AUTHORIZATION=ADMIN))
    assert data["total"] == 3
    assert [e["action"] for e in data["entries"]] == ["model.unload", "capture.delete", "model.load"]  # newest first
    first = data["entries"][0]
    assert set(first) == {
        "id", "created_at", "actor", "actor_kind", "action", "target", "params", "result", "message", "job_id",
        "finished_at",
    }  # fmt: skip
    assert first["target"] == {"kind": "model", "id": "1", "name": "tiny"}


def test_filters_and_pages(api, keys):
    rows = _seed()
    get = lambda query: ok(api.get(f"/api/audit?{query}", HTTP_AUTHORIZATION=ADMIN))  # noqa: E731
    assert [e["action"] for e in get("actor=alice")["entries"]] == ["capture.delete"]
    assert get("action=model.load")["total"] == 1
    assert get("action=model.")["total"] == 2  # a prefix ending in a dot
    assert get("target=model:1")["total"] == 2
    assert get("target=tiny")["total"] == 2
    assert get("target=cap_1")["total"] == 1
    assert get("result=CAPTURE_NOT_FOUND")["total"] == 1
    middle = rows[1].created_at
    assert [e["action"] for e in get(f"since={middle.isoformat().replace('+00:00', 'Z')}")["entries"]] == [
        "model.unload",
        "capture.delete",
    ]
    assert [e["action"] for e in get(f"until={middle.isoformat().replace('+00:00', 'Z')}")["entries"]] == ["model.load"]
    page = get("limit=2")
    assert (len(page["entries"]), page["total"], page["limit"], page["offset"]) == (2, 3, 2, 0)
    rest = get("limit=2&offset=2")
    assert [e["action"] for e in rest["entries"]] == ["model.load"]
    assert get("offset=100")["entries"] == []


def test_hostile_queries_are_refused_or_harmless(api, keys):
    _seed()
    get = lambda query: api.get(f"/api/audit?{query}", HTTP_AUTHORIZATION=ADMIN)  # noqa: E731
    refused(get("limit=1000000000"), 422, "VALIDATION_ERROR")
    refused(get("limit=0"), 422, "VALIDATION_ERROR")
    refused(get("limit=-5"), 422, "VALIDATION_ERROR")
    refused(get("offset=-1"), 422, "VALIDATION_ERROR")
    refused(get("limit=abc"), 422, "VALIDATION_ERROR")
    error = refused(get("since=yesterday"), 422, "VALIDATION_ERROR")
    assert "since" in error["details"]["fields"]
    refused(get("until=2026-13-45T99:00:00"), 422, "VALIDATION_ERROR")
    refused(get("since=2026-02-01T00:00:00Z&until=2026-01-01T00:00:00Z"), 422, "VALIDATION_ERROR")
    refused(get("actor=" + "a" * 5000), 422, "VALIDATION_ERROR")
    for hostile in ("actor=' OR 1=1 --", "target=1' OR '1'='1", "action=%25", "target=model:1;DROP TABLE x"):
        assert ok(get(hostile))["total"] == 0, hostile
    assert AuditEntry.objects.count() == 3


# --- retention ------------------------------------------------------------------------


def test_the_sweeper_prunes_entries_past_the_retention_only(settings):
    from audit.services import audit_prune
    from batches import sweeper

    now = timezone.now()
    old = AuditEntry.objects.create(actor="root", actor_kind="admin_key", action="model.load")
    AuditEntry.objects.filter(pk=old.pk).update(created_at=now - timedelta(days=91))
    edge = AuditEntry.objects.create(actor="root", actor_kind="admin_key", action="model.unload")
    AuditEntry.objects.filter(pk=edge.pk).update(created_at=now - timedelta(days=89))
    fresh = AuditEntry.objects.create(actor="root", actor_kind="admin_key", action="sae.attach")

    settings.AUDIT_RETENTION_DAYS = 0  # keep forever
    assert audit_prune() == {"pruned": 0}
    assert AuditEntry.objects.count() == 3

    settings.AUDIT_RETENTION_DAYS = 90
    done = sweeper._sweep()  # what the batch sweeper runs every BATCH_SWEEP_INTERVAL_S
    assert done["audit_pruned"] == 1
    assert set(AuditEntry.objects.values_list("pk", flat=True)) == {edge.pk, fresh.pk}
