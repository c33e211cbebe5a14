"""/api/models/{id}/lease: grant (the id once, a hash stored), read, renew, release, the
LEASE_* limits, ended leases answering LEASE_EXPIRED, and what a lease blocks — loading
another model, unloading, swapping — for anyone who does not present it."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from django.utils import timezone

from leases.models import Lease
from orchestration import services as orchestration_services
from registry import job_lifecycle
from registry import services as registry_services
from registry.models import Job, Model
from tests.documents.conftest import ok, refused

pytestmark = pytest.mark.django_db

GRANT = {"holder": "  labeler-7  ", "reason": "scoring run 12", "ttl_seconds": 600}


def _grant(api, model, body=None):
    return ok(api.post(f"/api/models/{model.id}/lease", body or GRANT, format="json"), 201)


@pytest.fixture
def gpt2(tiny_assets):
    return registry_services.model_register_local(
        local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2"
    )


def test_grant_read_renew_release(api, llama):
    model = llama.model
    before = timezone.now()
    lease = _grant(api, model)
    lease_id = lease.pop("lease_id")
    assert lease_id.startswith("lease_") and len(lease_id) > 40
    assert (lease["holder"], lease["reason"], lease["ttl_seconds"]) == ("labeler-7", "scoring run 12", 600)
    assert lease["model_id"] == model.id and lease["model_name"] == "tiny-llama"
    row = Lease.objects.get()
    # stored only as its sha256: nothing in the row is the id
    assert row.id_hash == hashlib.sha256(lease_id.encode()).hexdigest()
    assert lease_id not in json.dumps([str(v) for v in Lease.objects.values().get().values()])
    assert timedelta(seconds=599) < row.expires_at - before < timedelta(seconds=601)

    shown = ok(api.get(f"/api/models/{model.id}/lease"))
    assert shown["last_ended"] is None and "lease_id" not in shown["lease"]
    assert shown["lease"]["holder"] == "labeler-7"
    assert 595 <= shown["lease"]["seconds_remaining"] <= 600
    detailed = ok(api.get("/api/health/detailed"))["lease"]
    assert detailed["holder"] == "labeler-7" and "lease_id" not in detailed

    refused(api.post(f"/api/models/{model.id}/lease", GRANT, format="json"), 409, "MODEL_LEASED")
    refused(api.post(f"/api/models/{model.id}/lease/renew", {}, format="json"), 400, "INVALID_LEASE_REQUEST")
    refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE="lease_unknown"),
        404,
        "LEASE_NOT_FOUND",
    )
    Lease.objects.update(expires_at=timezone.now() + timedelta(seconds=5))
    renewed = ok(
        api.post(
            f"/api/models/{model.id}/lease/renew", {"ttl_seconds": 3600}, format="json", HTTP_X_MILLM_LEASE=lease_id
        )
    )
    row.refresh_from_db()
    assert renewed["ttl_seconds"] == 3600 and row.ttl_seconds == 3600
    assert timedelta(seconds=3595) < row.expires_at - timezone.now() <= timedelta(seconds=3600)
    assert row.renewed_at > row.acquired_at

    released = ok(api.delete(f"/api/models/{model.id}/lease", HTTP_X_MILLM_LEASE=lease_id))
    assert released["end_reason"] == "released"
    row.refresh_from_db()
    assert (row.end_reason, row.ended_at is not None) == ("released", True)
    error = refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=lease_id),
        409,
        "LEASE_EXPIRED",
    )
    assert error["details"]["end_reason"] == "released"
    refused(api.delete(f"/api/models/{model.id}/lease", HTTP_X_MILLM_LEASE=lease_id), 409, "LEASE_EXPIRED")
    status = ok(api.get(f"/api/models/{model.id}/lease"))
    assert status["lease"] is None and status["last_ended"]["end_reason"] == "released"
    assert ok(api.get("/api/health/detailed"))["lease"] is None
    _grant(api, model)  # free again


def test_request_limits(api, llama, gpt2, settings):
    settings.LEASE_MAX_TTL_SECONDS = 900
    settings.LEASE_DEFAULT_TTL_SECONDS = 300
    model = llama.model
    for body, param in (
        ({**GRANT, "ttl_seconds": 901}, "ttl_seconds"),
        ({**GRANT, "ttl_seconds": 0}, "ttl_seconds"),
        ({**GRANT, "ttl_seconds": "60"}, "ttl_seconds"),
        ({**GRANT, "holder": "x" * 129}, "holder"),
        ({**GRANT, "holder": "   "}, "holder"),
        ({**GRANT, "reason": "r" * 513}, "reason"),
        ({"holder": "h"}, "reason"),
    ):
        error = refused(api.post(f"/api/models/{model.id}/lease", body, format="json"), 400, "INVALID_LEASE_REQUEST")
        assert error["details"]["param"] == param
    assert not Lease.objects.exists()  # never clamped, never stored
    refused(api.post(f"/api/models/{gpt2.id}/lease", GRANT, format="json"), 409, "MODEL_NOT_RESIDENT")
    refused(api.post("/api/models/9999/lease", GRANT, format="json"), 404, "MODEL_NOT_FOUND")
    lease = _grant(api, model, {"holder": "h" * 128, "reason": "r" * 512})
    assert lease["ttl_seconds"] == 300  # the default
    refused(
        api.post(
            f"/api/models/{model.id}/lease/renew",
            {"ttl_seconds": 901},
            format="json",
            HTTP_X_MILLM_LEASE=lease["lease_id"],
        ),
        400,
        "INVALID_LEASE_REQUEST",
    )
    # a lease id presented on another model's path is unknown there
    refused(
        api.post(f"/api/models/{gpt2.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=lease["lease_id"]),
        404,
        "LEASE_NOT_FOUND",
    )


def test_expiry_on_read_and_the_ended_memory(api, llama, settings):
    model = llama.model
    lease = _grant(api, model)
    Lease.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    status = ok(api.get(f"/api/models/{model.id}/lease"))
    assert status["lease"] is None and status["last_ended"]["end_reason"] == "expired"
    assert Lease.objects.get().end_reason == "expired"
    error = refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=lease["lease_id"]),
        409,
        "LEASE_EXPIRED",
    )
    assert error["details"]["end_reason"] == "expired"

    settings.LEASE_ENDED_MEMORY = 2
    ids = [lease["lease_id"]]
    for _ in range(3):
        granted = _grant(api, model)
        ids.append(granted["lease_id"])
        ok(api.delete(f"/api/models/{model.id}/lease", HTTP_X_MILLM_LEASE=granted["lease_id"]))
    assert Lease.objects.filter(ended_at__isnull=False).count() == 2  # pruned beyond memory
    refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=ids[0]),
        404,
        "LEASE_NOT_FOUND",
    )
    refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=ids[-1]),
        409,
        "LEASE_EXPIRED",
    )


def test_a_lease_blocks_model_changes_for_others_only(api, llama, gpt2):
    model = llama.model
    lease = _grant(api, model)
    error = refused(api.post(f"/api/models/{gpt2.id}/load"), 409, "MODEL_LEASED")
    assert error["details"] == {
        "holder": "labeler-7",
        "reason": "scoring run 12",
        "expires_at": error["details"]["expires_at"],
        "leased_model_id": model.id,
        "leased_model_name": "tiny-llama",
        "operation": "load",
        "target_model_id": gpt2.id,
    }
    refused(api.post(f"/api/models/{model.id}/unload"), 409, "MODEL_LEASED")
    refused(api.post(f"/api/models/{model.id}/unload", HTTP_X_MILLM_LEASE="lease_wrong"), 409, "MODEL_LEASED")
    assert not Job.objects.filter(kind__in=("model_load", "model_unload")).exists()
    # using the model is never blocked: attach, steer, configure monitoring
    relu = llama.attach("tiny-llama-L1-relu", 1)
    ok(api.post("/api/saes/steering", {"feature_idx": 1, "value": 2}, format="json"))
    ok(api.post(f"/api/saes/{relu.id}/detach", {}, format="json"))
    # the holder may
    queued = ok(api.post(f"/api/models/{gpt2.id}/load", HTTP_X_MILLM_LEASE=lease["lease_id"]), 202)
    assert queued["job"]["kind"] == "model_load"
    Job.objects.all().delete()
    queued = ok(api.post(f"/api/models/{model.id}/unload", HTTP_X_MILLM_LEASE=lease["lease_id"]), 202)
    assert queued["job"]["kind"] == "model_unload"
    Job.objects.all().delete()
    # a grant while a load or unload is in progress waits for it
    Lease.objects.all().delete()
    job_lifecycle.job_create(kind=Job.Kind.MODEL_LOAD, target="tiny-gpt2", model=gpt2)
    refused(api.post(f"/api/models/{model.id}/lease", GRANT, format="json"), 503, "MODEL_BUSY")


def test_the_lease_ends_with_the_model(api, llama):
    model = llama.model
    lease = _grant(api, model)
    orchestration_services.model_unload(model=Model.objects.get(pk=model.id))
    row = Lease.objects.get()
    assert row.end_reason == "model_unloaded" and row.ended_at is not None
    error = refused(
        api.post(f"/api/models/{model.id}/lease/renew", {}, format="json", HTTP_X_MILLM_LEASE=lease["lease_id"]),
        409,
        "LEASE_EXPIRED",
    )
    assert error["details"]["end_reason"] == "model_unloaded"
    # a row that stopped saying "loaded" (an engine restart recorded elsewhere) ends it too
    orchestration_services.model_load(model=Model.objects.get(pk=model.id))
    _grant(api, model)
    Model.objects.filter(pk=model.id).update(status=Model.Status.READY)
    assert ok(api.get(f"/api/models/{model.id}/lease"))["lease"] is None
    assert Lease.objects.filter(ended_at__isnull=True).count() == 0
    assert Lease.objects.order_by("-ended_at").first().end_reason == "model_unloaded"
