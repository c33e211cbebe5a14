"""/api/jobs: list (with filters), detail, cancel — for downloads and for loads."""

from __future__ import annotations

import pytest

from registry.models import Job, Model
from tests.api.conftest import MODEL_REPO, ok, refused

pytestmark = pytest.mark.django_db


def test_list_detail_and_cancel(api, hub, tiny_llama):
    download = ok(
        api.post(
            "/api/models", {"repo_id": MODEL_REPO, "quantization": "FP32", "custom_name": "hub-copy"}, format="json"
        ),
        202,
    )
    load = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    listed = ok(api.get("/api/jobs"))
    assert listed["total"] == 2
    assert [j["id"] for j in listed["jobs"]] == [load["job"]["id"], download["job"]["id"]]
    only = ok(api.get("/api/jobs?kind=model_load&status=queued"))
    assert [j["id"] for j in only["jobs"]] == [load["job"]["id"]]
    refused(api.get("/api/jobs?kind=nonsense"), 422, "VALIDATION_ERROR")
    refused(api.get("/api/jobs?limit=0"), 422, "VALIDATION_ERROR")

    detail = ok(api.get(f"/api/jobs/{download['job']['id']}"))
    assert (detail["kind"], detail["model_id"], detail["bytes_total"]) == (
        "model_download",
        download["model"]["id"],
        Job.objects.get(pk=download["job"]["id"]).bytes_total,
    )

    # cancelling a download job through /api/jobs is the model's cancel
    cancelled = ok(api.post(f"/api/jobs/{download['job']['id']}/cancel"))
    assert cancelled["status"] == "cancelled"
    assert Model.objects.get(pk=download["model"]["id"]).status == "error"
    # a queued load is cancelled at once and never runs
    assert ok(api.post(f"/api/jobs/{load['job']['id']}/cancel"))["status"] == "cancelled"
    from orchestration import tasks

    assert tasks.model_load_task(load["job"]["id"]) == "skipped"
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    refused(api.post(f"/api/jobs/{load['job']['id']}/cancel"), 409, "JOB_ALREADY_FINISHED")
    refused(api.get("/api/jobs/424242"), 404, "JOB_NOT_FOUND")
    refused(api.post("/api/jobs/424242/cancel"), 404, "JOB_NOT_FOUND")
