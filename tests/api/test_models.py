"""/api/models: register, preview, download (through the stand-in hub: the real
huggingface_hub code path), cancel, delete, lock/unlock, list and detail."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import pytest
from django.db import connection

from registry import tasks, transfer
from registry.models import Job, Model
from tests.api.conftest import GATED_REPO, MODEL_REPO, body, ok, refused
from tests.api.standin_hub import VALID_TOKEN

pytestmark = pytest.mark.django_db

DOCUMENTED_FIELDS = {
    "id",
    "name",
    "source",
    "repo_id",
    "quantization",
    "params",
    "architecture",
    "disk_size_mb",
    "estimated_memory_mb",
    "status",
    "locked",
    "device",
    "dtype",
    "loaded_at",
}


def _start_download(api, **extra) -> tuple[dict, dict]:
    data = ok(
        api.post(
            "/api/models",
            {"source": "huggingface", "repo_id": MODEL_REPO, "quantization": "FP32", **extra},
            format="json",
        ),
        202,
    )
    return data["model"], data["job"]


# --- local registration ------------------------------------------------------------------


def test_register_a_local_checkpoint(api, tiny_assets):
    path = tiny_assets.models["tiny-llama"].path
    data = ok(
        api.post(
            "/api/models",
            {"source": "local", "local_path": str(path), "custom_name": "my-llama", "quantization": "FP32"},
            format="json",
        ),
        201,
    )
    model = data["model"]
    assert DOCUMENTED_FIELDS <= set(model)
    assert (model["name"], model["source"], model["status"]) == ("my-llama", "local", "ready")
    assert model["architecture"] == "LlamaForCausalLM"
    assert model["params"] and model["disk_size_mb"] > 0 and model["estimated_memory_mb"] > 0
    row = Model.objects.get(pk=model["id"])
    assert (row.name, row.local_path, row.status) == ("my-llama", str(path.resolve()), "ready")
    # the same name twice is refused
    refused(
        api.post("/api/models", {"source": "local", "local_path": str(path), "custom_name": "my-llama"}, format="json"),
        409,
        "MODEL_ALREADY_EXISTS",
    )


@pytest.mark.parametrize("path", ["/etc", "/usr/lib", "relative/dir", "/nonexistent/dir", "/proc/self"])
def test_local_paths_refused(api, path):
    error = refused(
        api.post("/api/models", {"source": "local", "local_path": path}, format="json"), 400, "INVALID_LOCAL_PATH"
    )
    assert error["details"]["local_path"] == path
    assert not Model.objects.exists()


def test_local_source_needs_a_path_and_hub_source_a_repo(api):
    refused(api.post("/api/models", {"source": "local"}, format="json"), 422, "VALIDATION_ERROR")
    error = refused(api.post("/api/models", {"source": "huggingface"}, format="json"), 422, "VALIDATION_ERROR")
    assert "repo_id" in error["details"]["fields"]
    refused(api.post("/api/models", {"repo_id": "../../etc"}, format="json"), 422, "VALIDATION_ERROR")


def test_list_and_detail(api, tiny_llama):
    data = ok(api.get("/api/models"))
    assert data["total"] == 1 and data["loaded_model_id"] is None
    (item,) = data["models"]
    assert DOCUMENTED_FIELDS <= set(item)
    assert item["id"] == tiny_llama.id and item["params"].endswith("K")
    detail = ok(api.get(f"/api/models/{tiny_llama.id}"))
    assert detail == item
    refused(api.get("/api/models/999999"), 404, "MODEL_NOT_FOUND")


def test_lock_and_unlock(api, tiny_llama):
    assert ok(api.post(f"/api/models/{tiny_llama.id}/lock"))["locked"] is True
    assert Model.objects.get(pk=tiny_llama.id).locked
    refused(api.delete(f"/api/models/{tiny_llama.id}"), 409, "MODEL_LOCKED")
    assert ok(api.post(f"/api/models/{tiny_llama.id}/unlock"))["locked"] is False
    assert not Model.objects.get(pk=tiny_llama.id).locked
    refused(api.post("/api/models/424242/lock"), 404, "MODEL_NOT_FOUND")


def test_delete_a_local_model_keeps_the_users_files(api, tiny_llama):
    data = ok(api.delete(f"/api/models/{tiny_llama.id}"))
    assert data == {"status": "deleted", "id": tiny_llama.id, "freed_disk_mb": None}
    assert not Model.objects.filter(pk=tiny_llama.id).exists()
    assert Path(tiny_llama.local_path, "config.json").is_file()


def test_delete_refused_while_loaded(api, tiny_llama):
    Model.objects.filter(pk=tiny_llama.id).update(status="loaded")
    refused(api.delete(f"/api/models/{tiny_llama.id}"), 409, "MODEL_LOADED")
    assert Model.objects.filter(pk=tiny_llama.id).exists()


# --- preview -------------------------------------------------------------------------------


def test_preview_reports_size_architecture_and_memory_per_quantization(api, hub):
    data = ok(api.post("/api/models/preview", {"repo_id": MODEL_REPO}, format="json"))
    assert data["architecture"] == "LlamaForCausalLM" and data["is_gated"] is False
    assert data["sha"] == hub.repos[MODEL_REPO].sha
    assert data["parameter_count"] == hub.repos[MODEL_REPO].parameter_count
    assert set(data["estimated_sizes"]) == {"FP32", "FP16", "Q8", "Q4", "Q2"}
    sizes = data["estimated_sizes"]
    assert sizes["FP32"]["memory_mb"] > sizes["FP16"]["memory_mb"] > sizes["Q4"]["memory_mb"]
    paths = {f["path"] for f in data["files"]}
    assert "model.safetensors" in paths and "config.json" in paths
    # pickles and files in sub-folders are never offered
    assert not {"pytorch_model.bin", "original/consolidated.pth"} & paths


def test_preview_of_a_missing_repository(api, hub):
    error = refused(
        api.post("/api/models/preview", {"repo_id": "millm-test/nothing-here"}, format="json"), 404, "REPO_NOT_FOUND"
    )
    assert error["details"]["repo_id"] == "millm-test/nothing-here"


def test_preview_of_a_gated_repository(api, hub):
    refused(api.post("/api/models/preview", {"repo_id": GATED_REPO}, format="json"), 401, "GATED_MODEL_NO_TOKEN")
    refused(
        api.post("/api/models/preview", {"repo_id": GATED_REPO, "hf_token": "hf_wrong"}, format="json"),
        401,
        "INVALID_HF_TOKEN",
    )
    data = ok(api.post("/api/models/preview", {"repo_id": GATED_REPO, "hf_token": VALID_TOKEN}, format="json"))
    assert data["is_gated"] is True
    # the token reached the hub, on the file it needed
    assert any(r.authorization == f"Bearer {VALID_TOKEN}" and "/resolve/" in r.path for r in hub.requests)


def test_server_token_is_used_when_the_request_brings_none(api, hub, settings):
    settings.HF_TOKEN = VALID_TOKEN
    ok(api.post("/api/models/preview", {"repo_id": GATED_REPO}, format="json"))
    # a per-request token wins over the server's
    hub.requests.clear()
    refused(
        api.post("/api/models/preview", {"repo_id": GATED_REPO, "hf_token": "hf_other"}, format="json"),
        401,
        "INVALID_HF_TOKEN",
    )
    assert {r.authorization for r in hub.requests} == {"Bearer hf_other"}


def test_unknown_revision(api, hub):
    refused(
        api.post("/api/models/preview", {"repo_id": MODEL_REPO, "revision": "v9"}, format="json"),
        404,
        "REVISION_NOT_FOUND",
    )


# --- download --------------------------------------------------------------------------------


def test_download_records_progress_and_registers_the_model(api, hub, published, settings):
    model, job = _start_download(api, custom_name="hub-llama")
    assert (model["status"], model["repo_id"], model["name"]) == ("downloading", MODEL_REPO, "hub-llama")
    assert job["kind"] == "model_download" and job["status"] == "queued"
    row = Model.objects.get(pk=model["id"])
    assert row.status == "downloading" and row.local_path == ""
    expected = {
        n: d for n, d in hub.repos[MODEL_REPO].files.items() if "/" not in n and not n.endswith((".bin", ".md"))
    }
    assert Job.objects.get(pk=job["id"]).bytes_total == sum(len(d) for d in expected.values())

    assert tasks.model_download_task(job["id"]) == "succeeded"

    row.refresh_from_db()
    assert row.status == "ready" and row.architecture == "LlamaForCausalLM"
    target = Path(row.local_path)
    assert target == transfer.model_target_dir(row).resolve()
    assert target.parent == Path(settings.MODEL_CACHE_DIR).resolve()
    on_disk = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    assert on_disk == expected  # byte for byte, and nothing else (no pickle, no .cache)
    assert not (target / ".cache").exists()
    finished = Job.objects.get(pk=job["id"])
    assert (finished.status, finished.progress) == ("succeeded", 100)
    assert finished.bytes_done == finished.bytes_total == sum(len(d) for d in expected.values())

    names = [name for name, _ in published]
    assert names[-1] == "model:download:complete"
    progress = [data for name, data in published if name == "model:download:progress"]
    assert len(progress) >= len(expected)
    percents = [p["percent"] for p in progress]
    assert percents == sorted(percents) and percents[-1] < 100
    assert all(p["model_id"] == row.id and p["job_id"] == job["id"] for p in progress)
    # the documented list now shows the model ready
    listed = ok(api.get("/api/models"))["models"][0]
    assert listed["status"] == "ready" and listed["download_progress"] is None


def test_download_of_the_same_repo_twice_is_refused(api, hub):
    _start_download(api)
    refused(
        api.post("/api/models", {"repo_id": MODEL_REPO, "quantization": "FP32"}, format="json"),
        409,
        "MODEL_ALREADY_EXISTS",
    )


def test_download_refusals_are_immediate(api, hub):
    refused(api.post("/api/models", {"repo_id": "millm-test/nothing-here"}, format="json"), 404, "REPO_NOT_FOUND")
    refused(api.post("/api/models", {"repo_id": GATED_REPO}, format="json"), 401, "GATED_MODEL_NO_TOKEN")
    assert not Model.objects.exists() and not Job.objects.exists()


def test_gated_download_with_a_token(api, hub):
    data = ok(
        api.post(
            "/api/models", {"repo_id": GATED_REPO, "hf_token": VALID_TOKEN, "quantization": "FP32"}, format="json"
        ),
        202,
    )
    # the task gets the request's token as an argument (the dispatcher would pass it)
    assert tasks.model_download_task(data["job"]["id"], hf_token=VALID_TOKEN) == "succeeded"
    assert Model.objects.get(pk=data["model"]["id"]).status == "ready"


def test_hf_token_is_never_stored_logged_or_echoed(api, hub, caplog):
    secret = VALID_TOKEN
    with caplog.at_level(logging.DEBUG):
        responses = [
            api.post("/api/models/preview", {"repo_id": GATED_REPO, "hf_token": secret}, format="json"),
            api.post("/api/models", {"repo_id": GATED_REPO, "hf_token": secret, "quantization": "FP32"}, format="json"),
        ]
        job_id = body(responses[1])["data"]["job"]["id"]
        tasks.model_download_task(job_id, hf_token=secret)
        responses.append(api.get("/api/models"))
        responses.append(api.get(f"/api/jobs/{job_id}"))
        responses.append(
            api.post("/api/models", {"repo_id": GATED_REPO, "hf_token": secret}, format="json")
        )  # refused: already exists
        responses.append(
            api.post(
                "/api/saes/download", {"repository_id": "x/y", "hf_token": secret, "revision": "r" * 200}, format="json"
            )
        )  # validation error echoes fields
    assert Model.objects.get().status == "ready"  # the token really was used
    for response in responses:
        assert secret not in response.content.decode()
    for record in caplog.records:
        assert secret not in record.getMessage()
        assert secret not in str(record.__dict__)
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
        for table in tables:
            cursor.execute(f'SELECT * FROM "{table}"')
            assert secret not in repr(cursor.fetchall()), table


def test_interrupted_transfer_resumes(api, hub, monkeypatch):
    from huggingface_hub import constants

    # bytes reach the file in chunks; smaller ones so half a file is several of them
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.interrupt["model.safetensors"] = "once"
    model, job = _start_download(api)
    assert tasks.model_download_task(job["id"]) == "succeeded"
    row = Model.objects.get(pk=model["id"])
    source = hub.repos[MODEL_REPO].files["model.safetensors"]
    written = Path(row.local_path, "model.safetensors").read_bytes()
    assert hashlib.sha256(written).digest() == hashlib.sha256(source).digest()
    # huggingface_hub resumed where the dropped connection stopped
    ranges = [r.range for r in hub.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert ranges[0] is None and ranges[1].startswith("bytes=")
    resumed_at = int(ranges[1][len("bytes=") : -1])
    assert 0 < resumed_at <= len(source) // 2 and resumed_at % (64 * 1024) == 0


def test_interrupted_transfer_that_cannot_resume_fails_cleanly(api, hub, published):
    hub.interrupt["model.safetensors"] = "fail"
    model, job = _start_download(api)
    assert tasks.model_download_task(job["id"]) == "ended"
    row = Model.objects.get(pk=model["id"])
    assert row.status == "error" and row.local_path == "" and row.error_message
    failed = Job.objects.get(pk=job["id"])
    assert failed.status == "failed" and failed.error
    # nothing half-written is left, and nothing is registered as ready
    assert not transfer.model_target_dir(row).exists()
    assert not Model.objects.filter(status="ready").exists()
    assert published[-1][0] == "model:download:error"
    # the failed row can be downloaded again (and this time the hub behaves)
    hub.interrupt.clear()
    data = ok(api.post("/api/models", {"repo_id": MODEL_REPO, "quantization": "FP32"}, format="json"), 202)
    assert data["model"]["id"] == row.id
    assert tasks.model_download_task(data["job"]["id"]) == "succeeded"
    assert Model.objects.get(pk=row.id).status == "ready"


def test_cancel_a_queued_download(api, hub, published):
    model, job = _start_download(api)
    data = ok(api.post(f"/api/models/{model['id']}/cancel"))
    assert data["job"]["status"] == "cancelled"
    assert Model.objects.get(pk=model["id"]).status == "error"
    assert published[-1] == (
        "model:download:error",
        {"job_id": job["id"], "model_id": model["id"], "error": "Download cancelled"},
    )
    # the task, when it runs, finds the job ended and does nothing
    assert tasks.model_download_task(job["id"]) == "ended"
    assert not transfer.model_target_dir(Model.objects.get(pk=model["id"])).exists()
    refused(api.post(f"/api/models/{model['id']}/cancel"), 409, "JOB_ALREADY_FINISHED")


@pytest.mark.django_db(transaction=True)
def test_cancel_a_running_download(api, hub):
    """In the background, as served: the job runs on the in-process downloads pool."""
    hub.delay["model.safetensors"] = 1.0
    model, job = _start_download(api)
    _wait_for(lambda: Job.objects.get(pk=job["id"]).status == "running")
    data = ok(api.post(f"/api/models/{model['id']}/cancel"))
    assert data["job"]["cancel_requested"] is True
    _wait_for(lambda: Job.objects.get(pk=job["id"]).status == "cancelled")
    row = Model.objects.get(pk=model["id"])
    assert (row.status, row.error_message) == ("error", "Download cancelled")
    _wait_for(lambda: not transfer.model_target_dir(row).exists())


def _wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_download_timeout(api, hub, settings):
    settings.DOWNLOAD_TIMEOUT = 1.0
    hub.delay["model.safetensors"] = 1.2
    model, job = _start_download(api)
    assert tasks.model_download_task(job["id"]) == "ended"
    failed = Job.objects.get(pk=job["id"])
    assert failed.status == "failed" and "DOWNLOAD_TIMEOUT" in failed.error
    assert Model.objects.get(pk=model["id"]).status == "error"


def test_delete_a_downloaded_model_removes_its_files(api, hub):
    model, job = _start_download(api)
    tasks.model_download_task(job["id"])
    target = Path(Model.objects.get(pk=model["id"]).local_path)
    assert target.is_dir()
    with api_commit():
        data = ok(api.delete(f"/api/models/{model['id']}"))
    assert data["freed_disk_mb"] > 0
    assert not target.exists() and not Model.objects.exists()


def test_trust_remote_code_is_an_opt_in(api, hub, settings):
    repo = hub.repos[MODEL_REPO]
    repo.config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    repo.files["modeling_x.py"] = b"raise SystemExit('remote code ran')\n"
    try:
        refused(api.post("/api/models", {"repo_id": MODEL_REPO}, format="json"), 400, "UNSUPPORTED_MODEL")
        # the operator's opt-in first (ALLOW_REMOTE_CODE, off by default: tests/security)
        settings.ALLOW_REMOTE_CODE = True
        data = ok(
            api.post(
                "/api/models", {"repo_id": MODEL_REPO, "trust_remote_code": True, "quantization": "FP32"}, format="json"
            ),
            202,
        )
        tasks.model_download_task(data["job"]["id"])
        row = Model.objects.get(pk=data["model"]["id"])
        assert row.trust_remote_code and Path(row.local_path, "modeling_x.py").is_file()
    finally:
        repo.config.pop("auto_map")
        repo.files.pop("modeling_x.py")


# --- the hub's circuit breaker -----------------------------------------------------------


def test_hub_outage_opens_the_breaker(api, hub, settings):
    hub.outage = True
    for _ in range(settings.HF_CIRCUIT_FAIL_MAX):
        response = api.post("/api/models/preview", {"repo_id": MODEL_REPO}, format="json")
        refused(response, 503, "HUB_UNAVAILABLE")
        assert int(response["Retry-After"]) >= 1
    circuits = ok(api.get("/api/health/circuits"))["circuits"]
    assert circuits[0]["name"] == "huggingface" and circuits[0]["state"] == "open"

    # while open, calls are refused at once without reaching the hub
    seen = len(hub.requests)
    response = api.post("/api/models", {"repo_id": MODEL_REPO}, format="json")
    error = refused(response, 503, "HUB_UNAVAILABLE")
    assert len(hub.requests) == seen
    assert 1 <= int(response["Retry-After"]) <= settings.HF_CIRCUIT_RESET_TIMEOUT_S
    assert error["details"]["state"] == "open"
    assert not Model.objects.exists()
    detailed = ok(api.get("/api/health/detailed"))
    assert detailed["circuit_breakers"][0]["is_open"] is True

    # the hub comes back; an operator closes the breaker
    hub.outage = False
    refused(api.post("/api/health/circuits/nope/reset"), 404, "CIRCUIT_NOT_FOUND")
    state = ok(api.post("/api/health/circuits/huggingface/reset"))
    assert (state["state"], state["failure_count"]) == ("closed", 0)
    ok(api.post("/api/models/preview", {"repo_id": MODEL_REPO}, format="json"))


def test_client_errors_do_not_trip_the_breaker(api, hub, settings):
    for _ in range(settings.HF_CIRCUIT_FAIL_MAX + 1):
        refused(
            api.post("/api/models/preview", {"repo_id": "millm-test/missing"}, format="json"), 404, "REPO_NOT_FOUND"
        )
    assert ok(api.get("/api/health/circuits"))["circuits"][0]["state"] == "closed"


def test_unreachable_hub(api, hub, settings):
    settings.HF_ENDPOINT = "http://127.0.0.1:9"  # discard port: connection refused
    response = api.post("/api/models/preview", {"repo_id": MODEL_REPO}, format="json")
    error = refused(response, 503, "HUB_UNAVAILABLE")
    assert error["details"]["cause"] and response["Retry-After"]


class api_commit:
    """Run on_commit callbacks of the block (the file removal after a delete)."""

    def __enter__(self):
        from django.test import TestCase

        self._ctx = TestCase.captureOnCommitCallbacks(execute=True)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_json_is_what_the_docs_show(api, tiny_llama):
    data = json.loads(api.get(f"/api/models/{tiny_llama.id}").content)
    assert isinstance(data["data"]["id"], int)
    assert isinstance(data["data"]["locked"], bool)
