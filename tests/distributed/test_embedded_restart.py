"""The embedded topology started the way any ASGI deployment starts it: ``daphne
millm_site.asgi:application`` directly (not ``manage.py serve``), on a PostgreSQL database
of its own, in a real OS process.

- An unload whose /v1 streams outlast GRACEFUL_UNLOAD_TIMEOUT stops the one running (the
  client gets an error frame, model_busy), refuses those waiting, and goes ahead.
- After ``kill -9`` and a restart, the rows and the engine agree: the model and the SAE
  the registry records come back (requests are steered again), and load, unload, attach
  and detach work from there.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.distributed.conftest import PYTHON, REPO, Proc, base_env, free_port
from tests.distributed.test_processes import Outcome, chat_body, stream_chat, wait_for
from tests.fixtures.assets import asset_cache_dir

pytestmark = pytest.mark.slow

# daphne with the embedded engine, its generations held at their HOLD_AT-th token while
# the test's hold file exists (held_engine.py): the stream running when the unload's grace
# period runs out is still running then on any machine (a stream long enough for the
# slowest machine ended before the unload on a fast one: CI, 2026-12-05 and 2026-12-07)
HELD_DAPHNE = [PYTHON, str(REPO / "tests" / "distributed" / "held_engine.py"), "daphne"]
GRACE_S = 0.2
LONG = 480
STREAMS = 4


class Embedded:
    def __init__(self, tmp: Path, database_url: str, procs: list[Proc]) -> None:
        self.tmp = tmp
        self.procs = procs
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = base_env(
            DATABASE_URL=database_url,
            SECRET_KEY="embedded-test-secret-key-0123456789abcdef",
            MILLM_DATA_DIR=str(tmp / "data"),
            LOG_LEVEL="INFO",
            MILLM_ENGINE_DEVICE="cpu",
            MILLM_ENGINE_DTYPE="float32",
            GRACEFUL_UNLOAD_TIMEOUT=str(GRACE_S),
            MAX_CONCURRENT_REQUESTS=str(STREAMS),
            MILLM_TEST_HOLD_FILE=str(tmp / "hold"),
        )
        self.hold = tmp / "hold"

    def manage(self, *args: str) -> None:
        import subprocess

        result = subprocess.run(
            [PYTHON, str(REPO / "manage.py"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    def start(self, name: str) -> Proc:
        proc = Proc(
            name,
            [*HELD_DAPHNE, "-b", "127.0.0.1", "-p", str(self.port), "millm_site.asgi:application"],
            self.env,
            self.tmp,
        )
        self.procs.append(proc)
        wait_for(f"{name} to answer", lambda: self.call("GET", "/api/health").status_code == 200, 120, [proc])
        return proc

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", timeout=60, **kw)

    def data(self, method: str, path: str, status: int = 200, **kw):
        resp = self.call(method, path, **kw)
        assert resp.status_code == status, resp.text
        return resp.json()["data"]

    def run_job(self, path: str) -> dict:
        job_id = self.data("POST", path, 202)["job"]["id"]
        return wait_for(
            f"job {job_id}",
            lambda: (j := self.data("GET", f"/api/jobs/{job_id}"))["status"] in ("succeeded", "failed") and j,
            120,
            self.procs,
        )

    def model(self, name: str) -> dict:
        return next(m for m in self.data("GET", "/api/models")["models"] if m["name"] == name)

    def attachments(self) -> list[tuple[str, int]]:
        rows = self.data("GET", "/api/saes/attachments")["entries"]
        return [(a["sae_id"], a["layer"]) for a in rows]

    def steer(self) -> httpx.Response:
        return self.call(
            "POST", "/v1/chat/completions", json=chat_body(4, steering={"features": [{"index": 3, "strength": 8}]})
        )

    def steered(self) -> int:
        """Forward passes that really added the steering delta in one request: > 0 only
        when the engine holds the attachment."""
        resp = self.steer()
        assert resp.status_code == 200, resp.text
        counts = resp.json()["millm"]["steering_apply_count"]
        return sum(c["count"] for c in counts)


@pytest.fixture
def embedded(tmp_path, pg_database_url, procs, tiny_assets) -> Embedded:
    e = Embedded(tmp_path, pg_database_url, procs)
    e.manage("migrate", "--noinput")
    e.manage(
        "shell",
        "-c",
        textwrap.dedent(f"""
        from pathlib import Path
        from registry.services import demo_assets_install
        demo_assets_install(root=Path({str(asset_cache_dir())!r}), include_demo=False)
        """),
    )
    return e


def test_embedded_unload_past_the_grace_period_and_a_restart(embedded: Embedded, procs: list[Proc]):
    e = embedded
    server = e.start("daphne-1")
    llama = e.model("tiny-llama")
    assert e.run_job(f"/api/models/{llama['id']}/load")["status"] == "succeeded"

    # --- streams that outlast GRACEFUL_UNLOAD_TIMEOUT: stopped, and the unload goes on.
    # The engine here is serial and admits all of them; the first is held at its
    # HOLD_AT-th token (the hold file) until the unload stops it, the others wait behind it.
    # They refuse an on-demand load, so that one still waiting when the unload is done does
    # not bring the model back.
    e.hold.touch()
    outs = [Outcome() for _ in range(STREAMS)]
    streamers = [
        threading.Thread(target=stream_chat, args=(e.url, chat_body(LONG), out, 120, {"X-miLLM-Load-Policy": "refuse"}))
        for out in outs
    ]
    for t in streamers:
        t.start()
    wait_for("a stream's first token", lambda: any(o.first_token.is_set() for o in outs), 60, procs, every_s=0.01)
    asked = time.monotonic()
    job = e.run_job(f"/api/models/{llama['id']}/unload")
    for t in streamers:
        t.join(60)
    e.hold.unlink()  # nothing later in the test is held (its requests ask fewer tokens anyway)
    assert job["status"] == "succeeded", job
    stopped = [o for o in outs if not o.finished]
    # the stream running when the grace period ran out: its tokens, then an error frame
    cut = [o for o in stopped if o.status == 200]
    assert cut and all(o.first_token.is_set() for o in cut), outs
    for out in cut:
        assert out.error["code"] == "model_busy" and out.done, out
        assert out.ended_at - asked >= GRACE_S - 0.1, (out, asked)
    # the ones still waiting: refused, never run after the unload
    for out in stopped:
        if out.status != 200:
            code = json.loads(out.body)["error"]["code"]
            assert (out.status, code) in ((503, "model_busy"), (409, "model_not_resident")), out
            assert out.status != 503 or out.retry_after, out
    for out in outs:
        assert out.finished == (out.error is None and out.done and out.status == 200), out
    assert e.model("tiny-llama")["status"] == "ready"
    health = e.data("GET", "/api/health/detailed")
    assert health["model_loaded"] is False

    # --- load and attach, then kill -9 the server
    assert e.run_job(f"/api/models/{llama['id']}/load")["status"] == "succeeded"
    sae_id = next(s["id"] for s in e.data("GET", "/api/saes")["saes"] if s["name"] == "tiny-llama-L1-relu")
    e.data("POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert e.steered() > 0
    server.kill9()

    # --- started again directly under daphne: what the rows say is what the engine holds,
    # and an AUTO_LOAD_MODEL naming another model does not swap the restored (locked) one
    # out (it used to stop the start-up with MODEL_LOCKED)
    e.env["AUTO_LOAD_MODEL"] = "tiny-gpt2"
    e.start("daphne-2")
    assert e.model("tiny-gpt2")["status"] == "ready"
    row = e.model("tiny-llama")
    assert (row["status"], row["locked"]) == ("loaded", True), row
    assert e.attachments() == [(sae_id, 1)]
    ready = e.call("GET", "/api/health/ready")
    assert ready.status_code == 200, ready.text
    assert ready.json()["data"]["model_loaded"] is True
    # and readiness says why AUTO_LOAD_MODEL did not apply
    auto_load = ready.json()["data"]["auto_load_model"]
    assert (auto_load["configured"], auto_load["resident"], auto_load["applied"]) == ("tiny-gpt2", "tiny-llama", False)
    assert "locked" in auto_load["reason"], auto_load
    assert e.data("GET", "/api/health/detailed")["model_name"] == "tiny-llama"
    assert e.steered() > 0  # the SAE is really attached in the new engine

    # --- and the operator can move on: detach, unload, load, attach
    e.data("POST", f"/api/saes/{sae_id}/detach", json={"layer": 1})
    assert e.attachments() == []
    assert e.steer().json()["error"]["code"] == "sae_not_attached"
    assert e.model("tiny-llama")["locked"] is False
    assert e.run_job(f"/api/models/{llama['id']}/unload")["status"] == "succeeded"
    assert e.model("tiny-llama")["status"] == "ready"
    assert e.data("GET", "/api/health/detailed")["model_loaded"] is False
    assert e.run_job(f"/api/models/{llama['id']}/load")["status"] == "succeeded"
    e.data("POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert e.steered() > 0
