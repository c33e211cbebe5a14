"""Captures, probes and the monitoring history on a live server (issue 31, items 6 and 10):

- they belong to the key that made them: another inference key neither lists nor reads,
  downloads, analyses, validates or deletes them (404, as for an id that does not exist,
  and the object is still there afterwards); an admin key sees all; a /v1 request's
  capture and monitoring records are its key's;
- a capture that would pass CAPTURE_DIR_MAX_BYTES is refused before generation with 507
  in /v1's shape naming the setting, and nothing is written;
- stored captures leave the disk after CAPTURE_RETENTION_S with nobody running a command
  (a ``manage.py serve`` of its own, which starts the pruner as any deployment does).
"""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.engine.helpers import count_forwards
from tests.served import served_process
from tests.v1.conftest import _v1_db, attach, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

ALICE, BOB, ROOT = "alice-secret-0123456789", "bob-secret-0123456789", "root-secret-0123456789"
SAE = "tiny-llama-L1-relu"
PROMPT = [5, 17, 23, 42, 8, 11]


@pytest.fixture
def keys(settings, tmp_path):
    settings.MILLM_API_KEYS = [f"alice:{ALICE}", f"bob:{BOB}"]
    settings.MILLM_ADMIN_API_KEYS = [f"root:{ROOT}"]
    settings.CAPTURE_DIR = str(tmp_path / "captures")
    settings.CAPTURE_INLINE_MAX_BYTES = 0  # every capture is stored
    return settings


def call(server, key, method, path, body=None, **kw):
    headers = {"Authorization": f"Bearer {key}", **kw.pop("headers", {})}
    return request(server.url, method, path, body, headers=headers, **kw)


def completion(server, key, **extra):
    resp = call(
        server,
        key,
        "POST",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra},
    )
    return resp


def _probe_file() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, weights=np.arange(1.0, 5.0), bias=np.array(0.5))
    return buf.getvalue()


def _import_probe(server, key, name):
    import requests

    return requests.post(
        f"{server.url}/api/probes/import",
        headers={"Authorization": f"Bearer {key}"},
        files={"file": ("p.npz", _probe_file(), "application/octet-stream")},
        data={"name": name, "layer": "0"},
        timeout=60,
    )


# ----------------------------------------------------------------------------- probes


def test_one_keys_probe_is_a_404_for_another_and_all_the_admins(llama, keys):
    from monitoring.models import Probe

    made = _import_probe(llama, ALICE, "secret-probe")
    assert made.status_code == 201, made.text
    probe_id = made.json()["data"]["id"]
    assert Probe.objects.get(id=probe_id).owner == "key:alice"

    listed = call(llama, BOB, "GET", "/api/probes").json()["data"]
    assert listed == {"probes": [], "total": 0}
    for ref in (probe_id, "secret-probe"):
        for method, path in (
            ("GET", f"/api/probes/{ref}"),
            ("DELETE", f"/api/probes/{ref}"),
            ("POST", f"/api/probes/{ref}/validate"),
        ):
            resp = call(llama, BOB, method, path)
            assert resp.status == 404, (method, path, resp.body[:300])
            assert resp.json()["error"]["code"] == "PROBE_NOT_FOUND"
    # a /v1 request of bob's cannot name it either: the answer for an unknown probe
    resp = completion(llama, BOB, probes=[probe_id])
    assert resp.status == 404 and resp.json()["error"]["code"] == "probe_not_found"
    assert "secret-probe" not in resp.body.decode()
    assert Probe.objects.filter(id=probe_id).exists()  # nothing happened to it

    # bob's own probe of the same name is his, and reveals nothing of alice's
    mine = _import_probe(llama, BOB, "secret-probe")
    assert mine.status_code == 201, mine.text
    assert call(llama, BOB, "GET", "/api/probes").json()["data"]["total"] == 1

    seen = call(llama, ROOT, "GET", "/api/probes").json()["data"]
    assert sorted(p["owner"] for p in seen["probes"]) == ["key:alice", "key:bob"]
    got = call(llama, ALICE, "GET", "/api/probes/secret-probe").json()["data"]
    assert got["id"] == probe_id and got["weights"] == [1.0, 2.0, 3.0, 4.0]
    # arming applies to everyone's requests: an admin's act
    assert call(llama, ALICE, "POST", f"/api/probes/{probe_id}/arm").status == 403
    assert call(llama, ALICE, "DELETE", f"/api/probes/{probe_id}").status == 200
    assert not Probe.objects.filter(id=probe_id).exists()


# --------------------------------------------------------------------------- captures


def test_a_capture_made_through_v1_is_its_keys_alone(llama, keys):
    from monitoring.models import Capture

    resp = completion(llama, ALICE, capture={"layers": [0, 1], "positions": "all"})
    assert resp.status == 200, resp.body[:300]
    cap = resp.json()["millm"]["capture"]
    assert cap["inline"] is False
    cid = cap["id"]
    assert Capture.objects.get(id=cid).owner == "key:alice"
    files = sorted(p.name for p in Path(keys.CAPTURE_DIR).iterdir())
    assert files == [f"{cid}.json", f"{cid}.safetensors"]

    assert call(llama, BOB, "GET", "/api/captures").json()["data"]["total"] == 0
    for method, path, body in (
        ("GET", f"/api/captures/{cid}", None),
        ("GET", f"/api/captures/{cid}/download", None),
        ("POST", f"/api/captures/{cid}/analyze", {"name": "hidden_states"}),
        ("DELETE", f"/api/captures/{cid}", None),
    ):
        got = call(llama, BOB, method, path, body)
        assert got.status == 404, (method, path, got.body[:300])
        assert got.json()["error"]["code"] == "CAPTURE_NOT_FOUND"
    # still there, whole
    assert Capture.objects.filter(id=cid).exists()
    assert sorted(p.name for p in Path(keys.CAPTURE_DIR).iterdir()) == files

    listed = call(llama, ROOT, "GET", "/api/captures").json()["data"]
    assert [(c["id"], c["owner"]) for c in listed["captures"]] == [(cid, "key:alice")]
    mine = call(llama, ALICE, "GET", f"/api/captures/{cid}/download")
    assert mine.status == 200
    assert mine.body == (Path(keys.CAPTURE_DIR) / f"{cid}.safetensors").read_bytes()
    # an analyzer that reads a second stored capture by id (CoRe's na_capture) reads only
    # the caller's: bob's analyses cannot load alice's capture
    from core.runtime import runtime
    from monitoring.errors import CaptureNotFound
    from monitoring.ownership import Scope

    analyzers = runtime().analyzers
    with pytest.raises(CaptureNotFound):
        analyzers.context(Scope(owner="key:bob", all=False)).load_capture(cid)
    (bobs,) = analyzers.prepare([("hidden_states", {"layers": [0]})], Scope(owner="key:bob", all=False))
    with pytest.raises(CaptureNotFound):
        analyzers.context(bobs.scope).load_capture(cid)
    assert analyzers.context(Scope(owner="key:alice", all=False)).load_capture(cid).meta


def test_a_batch_lines_capture_is_its_batch_owners(llama, keys):
    from openai import OpenAI

    from monitoring.models import Capture

    line = {
        "custom_id": "c0",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": "tiny-llama",
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0,
            "capture": {"layers": [0], "positions": "last"},
        },
    }
    with OpenAI(base_url=llama.base_url, api_key=ALICE, max_retries=0, timeout=60) as alice:
        file = alice.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
        batch = alice.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while (batch := alice.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
        assert batch.status == "completed", batch
        answer = json.loads(alice.files.content(batch.output_file_id).content)
    cid = answer["response"]["body"]["millm"]["capture"]["id"]
    assert Capture.objects.get(id=cid).owner == "key:alice"
    assert call(llama, BOB, "GET", f"/api/captures/{cid}").status == 404
    assert call(llama, ALICE, "GET", f"/api/captures/{cid}").status == 200


def test_a_capture_over_the_directory_quota_is_507_before_generation(llama, keys):
    from monitoring.models import Capture

    first = completion(llama, ALICE, capture={"layers": [0], "positions": "last"})
    assert first.status == 200, first.body[:300]
    stored = Capture.objects.get()
    # room for nothing more than what is stored
    keys.CAPTURE_DIR_MAX_BYTES = stored.nbytes + 16
    with count_forwards(llama.engine.backend.model) as forwards:
        resp = completion(llama, BOB, capture={"layers": [0, 1], "positions": "all"})
    assert resp.status == 507, resp.body[:300]
    error = resp.json()["error"]
    assert error["code"] == "capture_store_full"
    assert "CAPTURE_DIR_MAX_BYTES" in error["message"]
    assert error["param"] == "capture"
    # nothing was generated or written
    assert forwards[0] == 0
    assert Capture.objects.count() == 1
    assert len(list(Path(keys.CAPTURE_DIR).iterdir())) == 2
    # without a capture the same request is served; once the store has room, captures are
    resp = completion(llama, BOB)
    assert resp.status == 200
    assert call(llama, ALICE, "DELETE", f"/api/captures/{stored.id}").status == 200
    resp = completion(llama, BOB, capture={"layers": [0], "positions": "last"})
    assert resp.status == 200, resp.body[:300]


# ---------------------------------------------------------------- monitoring history


def test_monitoring_history_is_per_key(llama, keys):
    from monitoring.models import ActivationRecord

    attach(SAE, 1)
    configured = call(
        llama,
        ROOT,
        "POST",
        "/api/monitoring/configure",
        {"enabled": True, "sae_id": None, "layer": 1, "top_k": 3, "positions": "last"},
    )
    assert configured.status == 200, configured.body[:300]
    mine = completion(llama, ALICE).json()["id"]
    theirs = completion(llama, BOB).json()["id"]
    assert set(ActivationRecord.objects.values_list("request_id", "owner")) == {
        (mine, "key:alice"),
        (theirs, "key:bob"),
    }

    seen = call(llama, ALICE, "GET", "/api/monitoring/history").json()["data"]
    assert {r["request_id"] for r in seen["records"]} == {mine} and seen["total"] == 1
    assert call(llama, ALICE, "GET", f"/api/monitoring/history?request_id={theirs}").json()["data"]["total"] == 0
    stats = call(llama, ALICE, "GET", "/api/monitoring/statistics").json()["data"]
    assert stats["total_activations"] == 1

    cleared = call(llama, BOB, "DELETE", "/api/monitoring/history")
    assert cleared.status == 200 and cleared.json()["data"]["deleted"] == 1
    assert list(ActivationRecord.objects.values_list("request_id", flat=True)) == [mine]
    assert call(llama, ROOT, "GET", "/api/monitoring/history").json()["data"]["total"] == 1
    # statistics reset and configuration are shared state: admin only
    assert call(llama, ALICE, "DELETE", "/api/monitoring/statistics").status == 403
    assert call(llama, ALICE, "POST", "/api/monitoring/enable", {"enabled": False}).status == 403


# ------------------------------------------------------------------------ retention


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_expired_captures_leave_the_disk_with_nobody_running_a_command(v1_server, django_db_blocker, tmp_path):
    from registry.models import Job

    name = "tiny-llama"  # registered (and committed) by the live-server fixtures
    captures = tmp_path / "captures"
    env = {
        "SECRET_KEY": "capture-retention-secret-key-0123456789abcdef",
        "MILLM_DATA_DIR": str(tmp_path),
        "AUTO_LOAD_MODEL": name,
        "MILLM_ENGINE_DEVICE": "cpu",
        "MILLM_ENGINE_DTYPE": "float32",
        "LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        "CAPTURE_INLINE_MAX_BYTES": "0",
        "CAPTURE_RETENTION_S": "2",
        "CAPTURE_PRUNE_INTERVAL_S": "1",
    }
    answered: dict = {}

    def captured(base: str) -> bool:  # ready, and the model it was told to load is resident
        status, answered["body"] = _post(
            base + "/v1/completions",
            {
                "model": name,
                "prompt": PROMPT,
                "max_tokens": 2,
                "temperature": 0,
                "capture": {"layers": [0], "positions": "last"},
            },
            timeout=30,
        )
        return status == 200

    try:
        with served_process(tmp_path, env, ready=captured, timeout_s=180) as serving:
            base, log, body = serving.url, serving.log, answered["body"]
            cid = body["millm"]["capture"]["id"]
            assert body["millm"]["capture"]["inline"] is False
            assert (captures / f"{cid}.safetensors").is_file()
            # gone for readers once expired, and from the disk at the next prune
            deadline = time.monotonic() + 15
            while (captures / f"{cid}.safetensors").exists() and time.monotonic() < deadline:
                time.sleep(0.25)
            assert not (captures / f"{cid}.safetensors").exists(), log.read_text()
            assert not (captures / f"{cid}.json").exists()
            assert _status(f"{base}/api/captures/{cid}") == 404
    finally:
        with django_db_blocker.unblock():
            from monitoring.models import Capture

            Capture.objects.all().delete()
            Job.objects.filter(model__name=name).delete()
