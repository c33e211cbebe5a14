"""State that holds across several web workers: two ``manage.py serve`` processes, a
Celery worker and ``manage.py run_engine`` on PostgreSQL and Redis of their own.

- Requests naming an unloaded model arrive on both workers at once: the model is loaded
  exactly once (one load job, one load command in the engine's log) and every request is
  answered.
- While a stream runs on worker A, an unload asked through worker B (run by Celery) waits
  for it: the stream finishes in full before the unload does, and meanwhile new /v1
  requests on either worker get 503 model_busy with Retry-After and start no load.
- An unload run from yet another process (the service the Celery task calls, with
  GRACEFUL_UNLOAD_TIMEOUT=0.2) stops a stream that outlasts its grace period (an error
  frame, model_busy) and goes ahead.

The streams that must still run while the test looks are held at a token by the engine
(``held_engine.py``) until the test lets them go, or the unload stops them: no stream
length is chosen for the machine's speed.
"""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import datetime

import httpx2 as httpx
import pytest

from tests.distributed.conftest import PYTHON, REPO, Proc
from tests.distributed.test_processes import (  # noqa: F401 - the cluster fixture
    Cluster,
    Outcome,
    chat_body,
    cluster,
    stream_chat,
    wait_for,
)

pytestmark = pytest.mark.slow

LONG = 480  # tokens: held at HOLD_AT (held_engine.py) while the test checks what it must
HELD_ENGINE = REPO / "tests" / "distributed" / "held_engine.py"


def _load_jobs(c: Cluster) -> list[dict]:
    return c.api("web-a", "GET", "/api/jobs", params={"kind": "model_load", "limit": 100}).json()["data"]["jobs"]


def _model(c: Cluster, web: str, name: str) -> dict:
    models = c.api(web, "GET", "/api/models").json()["data"]["models"]
    return next(m for m in models if m["name"] == name)


def test_loads_race_once_and_unloads_hold_across_workers(
    cluster: Cluster,  # noqa: F811
    procs: list[Proc],
):
    c = cluster
    c.env["GRACEFUL_UNLOAD_TIMEOUT"] = "120"  # the stream below finishes well within it
    hold = f"{c.prefix}:test-hold"
    c.env["MILLM_TEST_HOLD_KEY"] = hold
    engine = c.start("engine", [PYTHON, str(HELD_ENGINE)])
    c.start_web("web-a")
    c.start_web("web-b")
    c.start_worker()
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("both web servers", lambda: c.live("web-a") and c.live("web-b"), 60, procs)
    assert c.serving()["status"]["state"] == "empty"
    model_id = _model(c, "web-a", "tiny-llama")["id"]

    # --- requests for the unloaded model on both workers at once: one load
    results: list[httpx.Response | Exception] = []
    barrier = threading.Barrier(6)

    def ask(web: str) -> None:
        barrier.wait(10)
        try:
            results.append(httpx.post(f"{c.webs[web]}/v1/chat/completions", json=chat_body(4), timeout=180))
        except httpx.HTTPError as exc:
            results.append(exc)

    threads = [threading.Thread(target=ask, args=("web-a" if i % 2 else "web-b",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert len(results) == 6
    for resp in results:
        assert isinstance(resp, httpx.Response) and resp.status_code == 200, resp
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    jobs = _load_jobs(c)
    assert [(j["target"], j["status"]) for j in jobs] == [("tiny-llama", "succeeded")], jobs
    commands = engine.log_path.read_text().count("engine_command kind=load_model")
    assert commands == 1, engine.tail(80)
    assert c.serving()["status"]["model_id"] == "tiny-llama"

    # --- a stream on A; the unload asked through B runs on Celery and waits for it
    out = Outcome()
    c.redis.set(hold, "1")  # the stream waits at its HOLD_AT-th token until this goes
    streamer = threading.Thread(target=stream_chat, args=(c.webs["web-a"], chat_body(LONG), out, 180))
    streamer.start()
    wait_for("a stream on web-a", out.first_token.is_set, 60, procs, every_s=0.01)
    resp = c.api("web-b", "POST", f"/api/models/{model_id}/unload")
    assert resp.status_code == 202, resp.text
    unload_job = resp.json()["data"]["job"]["id"]
    # the engine has begun draining (the unload reached it from the Celery worker)
    wait_for(
        "the unload to start draining",
        lambda: (c.heartbeat() or {}).get("status", {}).get("draining") == "unloading",
        60,
        procs,
        every_s=0.02,
    )
    assert not out.ended_at, "the stream ended before the unload could be observed"
    for web in ("web-a", "web-b", "web-a", "web-b"):
        late = c.api(web, "POST", "/v1/chat/completions", json=chat_body(4))
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "model_busy", late.text
        assert int(late.headers["Retry-After"]) >= 1
        streamed = Outcome()
        stream_chat(c.webs[web], chat_body(4), streamed)
        assert streamed.status == 503 and streamed.retry_after, streamed
        assert '"model_busy"' in streamed.body
    assert _model(c, "web-a", "tiny-llama")["status"] == "unloading"
    assert not out.ended_at, "the held stream ended while the late requests were refused"
    c.redis.delete(hold)  # the stream goes on to its end, then the unload runs
    streamer.join(180)
    job = wait_for(
        "the unload job",
        lambda: (
            (j := c.api("web-b", "GET", f"/api/jobs/{unload_job}").json()["data"])["status"] in ("succeeded", "failed")
            and j
        ),
        120,
        procs,
    )
    assert job["status"] == "succeeded", job
    # the running stream was not cut: it finished in full, and before the unload did
    assert out.status == 200 and out.finished and out.done and out.error is None, out
    assert out.chunks > LONG // 2, out
    stream_end = time.time() - (time.monotonic() - out.ended_at)
    finished = datetime.fromisoformat(job["finished_at"]).timestamp()
    assert finished >= stream_end - 0.5, (finished, stream_end)
    # nothing loaded the model again meanwhile: the rows and the engine say unloaded
    assert _model(c, "web-b", "tiny-llama")["status"] == "ready"
    assert c.serving()["status"]["state"] == "empty"
    assert [j["status"] for j in _load_jobs(c)] == ["succeeded"]

    # --- an unload from another process, whose grace period a stream outlasts
    resp = c.api("web-b", "POST", "/v1/chat/completions", json=chat_body(4))  # loads again
    assert resp.status_code == 200, resp.text
    trigger, ready = c.tmp / "unload-now", c.tmp / "unloader-ready"
    # the service a Celery task calls, in a process of its own, set up before the stream
    unloader = subprocess.Popen(
        [PYTHON, str(REPO / "manage.py"), "shell", "-c", UNLOADER.format(trigger=str(trigger), ready=str(ready))],
        # the stream below is held until the unload stops it, past this grace period
        env={**c.env, "GRACEFUL_UNLOAD_TIMEOUT": "0.2"},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for("the unloader process", ready.exists, 120, procs)
        cut = Outcome()
        c.redis.set(hold, "1")  # held until the unload's grace period runs out and stops it
        streamer = threading.Thread(target=stream_chat, args=(c.webs["web-b"], chat_body(LONG), cut, 180))
        streamer.start()
        wait_for("a stream on web-b", cut.first_token.is_set, 60, procs, every_s=0.01)
        started = time.monotonic()
        trigger.touch()
        output, _ = unloader.communicate(timeout=120)
        streamer.join(60)
    finally:
        c.redis.delete(hold)
        if unloader.poll() is None:
            unloader.kill()
    assert unloader.returncode == 0, output[-3000:]
    assert "unloaded: ready" in output, output[-3000:]
    assert cut.status == 200 and cut.done and not cut.finished, cut
    assert cut.error is not None and cut.error["code"] == "model_busy", cut
    assert cut.ended_at - started >= 0.2, (cut, started)
    assert _model(c, "web-a", "tiny-llama")["status"] == "ready"
    assert c.serving()["status"]["state"] == "empty"


UNLOADER = """
import pathlib, time
from core.runtime import runtime
from orchestration.services import model_unload
from registry.models import Model
runtime().engine.status()
pathlib.Path({ready!r}).touch()
deadline = time.monotonic() + 120
while not pathlib.Path({trigger!r}).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
row = model_unload(model=Model.objects.get(name="tiny-llama"))
print("unloaded:", row.status)
"""
