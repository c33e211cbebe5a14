"""The served topology, as a user runs it: ``manage.py serve`` (daphne, embedded engine,
in-process job pools, in-memory channel layer) in its own process on a loopback port,
downloading from the stand-in hub. A real WebSocket client sees download and load
progress arrive in order and then complete; API keys guard HTTP and the socket;
AUTO_LOAD_MODEL loads at start-up and readiness waits for it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.api.conftest import MODEL_REPO
from tests.served import served_process

KEY = "live-server-test-key"

# The marker makes pytest-django create the test database; the server (another process)
# only sees what the module fixture commits, never a test's transaction.
pytestmark = pytest.mark.django_db


@dataclass
class Served:
    url: str
    process: subprocess.Popen
    log: Path

    def call(
        self, method: str, path: str, body: dict | None = None, *, key: bool = True, timeout: float = 30
    ) -> tuple[int, dict, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if key:
            request.add_header("Authorization", f"Bearer {KEY}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read()), dict(response.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read()), dict(exc.headers)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/ws/events"


@pytest.fixture(scope="module")
def served(django_db_setup, django_db_blocker, standin_hub, tiny_assets, tmp_path_factory):
    from registry import services
    from registry.models import SAE, Attachment, Job, Model

    with django_db_blocker.unblock():
        services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="auto-gpt2")
    root = tmp_path_factory.mktemp("served")
    env = {
        "SECRET_KEY": "live-server-secret-key-0123456789abcdef",
        "MILLM_DATA_DIR": str(root),
        "MODEL_CACHE_DIR": str(root / "models"),
        "SAE_CACHE_DIR": str(root / "saes"),
        "HF_ENDPOINT": standin_hub.url,
        "MILLM_ADMIN_API_KEYS": KEY,
        "AUTO_LOAD_MODEL": "auto-gpt2",
        "MILLM_ENGINE_DEVICE": "cpu",
        "MILLM_ENGINE_DTYPE": "float32",
        "LOG_LEVEL": "WARNING",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    try:
        with served_process(root, env) as serving:
            yield Served(serving.url, serving.process, serving.log)
    finally:
        with django_db_blocker.unblock():
            for model in (Attachment, Job, SAE, Model):
                model.objects.all().delete()


def test_serve_says_how_it_is_reachable(served):
    text = served.log.read_text()
    assert f"miLLM listening on {served.url}/" in text
    assert "API keys required" in text


def test_auto_load_and_readiness(served):
    deadline = time.monotonic() + 90
    not_ready = []
    while True:
        status, body, headers = served.call("GET", "/api/health/ready", key=False)
        if status == 200:
            break
        assert status == 503 and body["error"]["code"] == "NOT_READY", body
        assert headers["Retry-After"] == "5"
        not_ready.append(body["error"]["details"]["checks"])
        assert time.monotonic() < deadline, not_ready[-1]
        time.sleep(0.2)
    assert body["data"]["model_name"] == "auto-gpt2" and body["data"]["ready"] is True
    # until then, what was missing was the start-up load (not yet resident, or its job not
    # yet recorded)
    assert all(checks["auto_load_model"] is False or checks["no_model_transition"] is False for checks in not_ready)
    assert all(checks["database"] and checks["engine"] for checks in not_ready)
    status, listing, _ = served.call("GET", "/api/models")
    assert status == 200
    assert {m["name"]: m["status"] for m in listing["data"]["models"]}["auto-gpt2"] == "loaded"


def test_keys_guard_the_server(served):
    status, body, headers = served.call("GET", "/api/models", key=False)
    assert (status, body["error"]["code"]) == (401, "UNAUTHORIZED")
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert served.call("GET", "/api/health", key=False)[0] == 200
    status, body, _ = served.call("GET", "/v1/models", key=False)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(InvalidStatus) as refused:
        connect(served.ws_url, open_timeout=10).close()
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus):
        connect(served.ws_url + "?api_key=wrong", open_timeout=10).close()


def _events_until(ws, done, timeout_s: float = 90) -> list[tuple[str, dict]]:
    seen: list[tuple[str, dict]] = []
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no final event; saw {[n for n, _ in seen]}"
        message = json.loads(ws.recv(timeout=remaining))
        assert set(message) == {"event", "data"}
        seen.append((message["event"], message["data"]))
        if done(message["event"], message["data"]):
            return seen


def test_download_and_load_progress_over_a_real_websocket(served):
    with connect(served.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}, open_timeout=10) as ws:
        status, body, _ = served.call(
            "POST", "/api/models", {"repo_id": MODEL_REPO, "quantization": "FP32", "custom_name": "live-llama"}
        )
        assert status == 202, body
        model_id, job_id = body["data"]["model"]["id"], body["data"]["job"]["id"]

        events = _events_until(
            ws,
            lambda name, data: (
                name.startswith("model:download:") and not name.endswith("progress") and data["job_id"] == job_id
            ),
        )
        mine = [(n, d) for n, d in events if d.get("job_id") == job_id]
        assert mine[-1][0] == "model:download:complete"
        progress = [d for n, d in mine if n == "model:download:progress"]
        assert len(progress) >= 3
        assert [d["percent"] for d in progress] == sorted(d["percent"] for d in progress)
        assert [d["bytes_done"] for d in progress] == sorted(d["bytes_done"] for d in progress)
        assert all(d["model_id"] == model_id for d in progress)
        assert mine[-1][1]["percent"] == 100

        status, job, _ = served.call("GET", f"/api/jobs/{job_id}")
        assert job["data"]["status"] == "succeeded"
        assert job["data"]["bytes_done"] == job["data"]["bytes_total"] > 0
        status, model, _ = served.call("GET", f"/api/models/{model_id}")
        assert model["data"]["status"] == "ready"

        status, body, _ = served.call("POST", f"/api/models/{model_id}/load")
        assert status == 202, body
        load_job = body["data"]["job"]["id"]
        events = _events_until(
            ws,
            lambda name, data: name in ("model:load:complete", "model:load:error") and data.get("job_id") == load_job,
        )
        names = [n for n, d in events if d.get("job_id") == load_job]
        assert names[-1] == "model:load:complete"
        assert names[:-1] and set(names[:-1]) == {"model:load:progress"}
        percents = [d["percent"] for n, d in events if n == "model:load:progress" and d.get("job_id") == load_job]
        assert percents == sorted(percents)
        # the auto-loaded model made room for it
        assert any(n == "model:unload:complete" and d["reason"] == "replaced" for n, d in events)

    status, model, _ = served.call("GET", f"/api/models/{model_id}")
    assert (model["data"]["status"], model["data"]["device"]) == ("loaded", "cpu")
    status, detailed, _ = served.call("GET", "/api/health/detailed")
    assert detailed["data"]["model_name"] == "live-llama"
    assert detailed["data"]["inference"]["in_flight"] == 0
