"""/api/saes lifecycle: preview, download (idempotent), detail, list, delete, cancel — the
download through the stand-in hub."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry import tasks, transfer
from registry.models import SAE, Job
from tests.api.conftest import GATED_SAE_REPO, NPZ_PATH, SAE_REPO, SAELENS_DIR, ok, refused
from tests.api.standin_hub import VALID_TOKEN

pytestmark = pytest.mark.django_db

SAE_FIELDS = {
    "id",
    "name",
    "repository_id",
    "revision",
    "format",
    "d_in",
    "d_sae",
    "trained_on",
    "trained_layer",
    "width",
    "average_l0",
    "status",
    "created_at",
    "updated_at",
}


def test_preview_lists_the_sae_files(api, hub):
    data = ok(api.post("/api/saes/preview", {"repository_id": SAE_REPO}, format="json"))
    files = {f["path"]: f for f in data["files"]}
    assert set(files) == {
        f"{SAELENS_DIR}/sae_weights.safetensors",
        "tiny-llama-L3-relu/sae_weights.safetensors",
        NPZ_PATH,
    }
    assert data["total_files"] == 3
    npz = files[NPZ_PATH]
    assert (npz["layer"], npz["width"], npz["layout"]) == (2, "256", "gemmascope")
    assert npz["size_bytes"] == len(hub.repos[SAE_REPO].files[NPZ_PATH])
    assert files[f"{SAELENS_DIR}/sae_weights.safetensors"]["layer"] == 1
    refused(api.post("/api/saes/preview", {"repository_id": "millm-test/none"}, format="json"), 404, "REPO_NOT_FOUND")


@pytest.mark.parametrize(
    "file_path, layout, layer",
    [
        (NPZ_PATH, "gemmascope", 2),
        (f"{SAELENS_DIR}/sae_weights.safetensors", "saelens", 1),
        (SAELENS_DIR, "saelens", 1),
    ],
)
def test_download_an_sae(api, hub, published, file_path, layout, layer):
    data = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": file_path}, format="json"), 202)
    assert data["status"] == "downloading" and data["sae_id"].startswith("sae_")
    row = SAE.objects.get(pk=data["sae_id"])
    assert row.status == "downloading" and row.trained_on_layer == layer

    assert tasks.sae_download_task(data["job"]["id"]) == "succeeded"
    row.refresh_from_db()
    assert (row.status, row.format, row.d_in, row.d_sae) == ("ready", layout, 64, row.d_sae)
    assert row.d_sae and row.trained_on_layer == layer
    assert Path(row.local_path).is_relative_to(transfer.sae_target_dir(row))
    job = Job.objects.get(pk=data["job"]["id"])
    assert (job.status, job.progress) == ("succeeded", 100)
    assert job.bytes_done == job.bytes_total > 0
    assert published[-1][0] == "sae:download:complete"
    assert published[-1][1]["sae_id"] == row.id
    detail = ok(api.get(f"/api/saes/{row.id}"))
    assert SAE_FIELDS <= set(detail)
    assert detail["status"] == "ready" and detail["memory_usage_mb"] > 0

    # idempotent per repository + revision + path
    again = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": file_path}, format="json"), 202)
    assert (again["sae_id"], again["status"], again["job"]) == (row.id, "cached", None)
    assert SAE.objects.count() == 1


def test_download_in_progress_is_reported_not_repeated(api, hub):
    first = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    second = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    assert second["status"] == "already_downloading"
    assert second["sae_id"] == first["sae_id"] and second["job"]["id"] == first["job"]["id"]
    assert Job.objects.count() == 1


def test_download_refusals(api, hub):
    refused(
        api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": "no/such/dir"}, format="json"),
        400,
        "SAE_INVALID",
    )
    refused(api.post("/api/saes/download", {"repository_id": "millm-test/none"}, format="json"), 404, "REPO_NOT_FOUND")
    refused(
        api.post("/api/saes/download", {"repository_id": GATED_SAE_REPO, "file_path": NPZ_PATH}, format="json"),
        401,
        "GATED_MODEL_NO_TOKEN",
    )
    error = refused(
        api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": "../etc/passwd"}, format="json"),
        422,
        "VALIDATION_ERROR",
    )
    assert "file_path" in error["details"]["fields"]
    assert not SAE.objects.exists()


def test_gated_sae_with_a_token(api, hub):
    data = ok(
        api.post(
            "/api/saes/download",
            {"repository_id": GATED_SAE_REPO, "file_path": NPZ_PATH, "hf_token": VALID_TOKEN},
            format="json",
        ),
        202,
    )
    assert tasks.sae_download_task(data["job"]["id"], hf_token=VALID_TOKEN) == "succeeded"
    assert SAE.objects.get(pk=data["sae_id"]).status == "ready"


def test_failed_sae_download_leaves_nothing(api, hub):
    hub.interrupt[NPZ_PATH] = "fail"
    data = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    assert tasks.sae_download_task(data["job"]["id"]) == "ended"
    row = SAE.objects.get(pk=data["sae_id"])
    assert row.status == "error" and row.local_path == ""
    assert not transfer.sae_target_dir(row).exists()
    assert Job.objects.get(pk=data["job"]["id"]).status == "failed"


def test_cancel_an_sae_download(api, hub, published):
    data = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    cancelled = ok(api.post(f"/api/saes/{data['sae_id']}/cancel"))
    assert cancelled["status"] == "error" and cancelled["job"]["status"] == "cancelled"
    assert published[-1][0] == "sae:download:error"
    refused(api.post(f"/api/saes/{data['sae_id']}/cancel"), 409, "JOB_ALREADY_FINISHED")
    # a cancelled download is started again by asking for it again
    again = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    assert again["status"] == "downloading" and again["sae_id"] == data["sae_id"]


def test_list_detail_and_delete(api, llama_saes):
    data = ok(api.get("/api/saes"))
    assert data["total"] == len(llama_saes)
    assert data["attachment"]["is_attached"] is False
    assert {s["id"] for s in data["saes"]} == {s.id for s in llama_saes.values()}
    sae = llama_saes["tiny-llama-L1-relu"]
    detail = ok(api.get(f"/api/saes/{sae.id}"))
    assert (detail["d_in"], detail["trained_layer"], detail["attached_layers"]) == (64, 1, [])
    refused(api.get("/api/saes/sae_doesnotexist"), 404, "SAE_NOT_FOUND")
    assert ok(api.delete(f"/api/saes/{sae.id}"))["status"] == "deleted"
    assert not SAE.objects.filter(pk=sae.id).exists()
    # an SAE registered from the user's own folder keeps its files
    assert Path(sae.local_path).exists()
    refused(api.delete(f"/api/saes/{sae.id}"), 404, "SAE_NOT_FOUND")


def test_delete_a_downloaded_sae_removes_its_files(api, hub):
    from django.test import TestCase

    data = ok(api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    tasks.sae_download_task(data["job"]["id"])
    target = transfer.sae_target_dir(SAE.objects.get(pk=data["sae_id"]))
    assert target.is_dir()
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert ok(api.delete(f"/api/saes/{data['sae_id']}"))["freed_disk_mb"] > 0
    assert not target.exists()
