"""The distributed topology as separate OS processes on loopback: two ``manage.py serve``
web servers, a Celery worker and ``manage.py run_engine``, on a PostgreSQL database and a
Redis database of their own.

One test walks through what operators rely on: a model and SAE loaded through the API
(load as a Celery job, reaching the engine over Redis), several clients streaming at once,
``kill -9`` of the engine mid-stream (every client gets an error frame or a 503 with
Retry-After in bounded time; later requests get model_not_loaded), a restart that
restores the model and its attachment from the database (requests succeed again; the
interrupted jobs went to the dead-letter stream and were not generated twice), ``kill -9``
of a web server (the other keeps serving; the job it accepted just before still
completes), a web process that never imports torch, and a clean SIGTERM of the engine.
Every wait is bounded; every child's process group is killed at teardown.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import redis

from gpu_engine.api.transport import Keys
from tests.distributed.conftest import CELERY, PYTHON, REPO, Proc, base_env, free_port
from tests.fixtures.assets import asset_cache_dir

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.25
DEAD_AFTER_S = 1.5
LONG = 480  # tokens: tiny-llama's window is 512, so a stream lasts seconds
# error bound after a kill: no heartbeat for DEAD_AFTER_S, noticed within a heartbeat
# period, plus slack for two busy cores
ERROR_BOUND_S = DEAD_AFTER_S + HEARTBEAT_S + 8.0


def wait_for(what: str, check, timeout_s: float, procs: list[Proc] = (), every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except (httpx.HTTPError, redis.RedisError, ValueError, KeyError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            logs = "\n".join(p.tail() for p in procs)
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{logs}")
        for p in procs:
            if not p.alive() and not p.stopped_on_purpose:
                raise AssertionError(f"{p.name} exited ({p.popen.returncode})\n{p.tail()}")
        time.sleep(every_s)


@dataclass
class Outcome:
    """What one streaming client saw."""

    status: int | None = None
    retry_after: str | None = None
    chunks: int = 0
    error: dict[str, Any] | None = None
    done: bool = False
    finished: bool = False
    ended_at: float | None = None
    body: str = ""
    first_token: threading.Event = field(default_factory=threading.Event)

    @property
    def clean_error(self) -> bool:
        frame = self.status == 200 and self.error is not None and self.done
        refused = self.status == 503 and bool(self.retry_after)
        return frame or refused


def stream_chat(
    base: str, body: dict[str, Any], out: Outcome, timeout_s: float = 60, headers: dict[str, str] | None = None
) -> None:
    try:
        with (
            httpx.Client(timeout=timeout_s) as client,
            client.stream(
                "POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, headers=headers
            ) as resp,
        ):
            out.status = resp.status_code
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                out.body = resp.read().decode()
                return
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = obj["error"]
                    continue
                for choice in obj.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        out.chunks += 1
                        out.first_token.set()
                    if choice.get("finish_reason"):
                        out.finished = True
    except httpx.HTTPError as exc:
        out.body = f"transport error: {exc!r}"
    finally:
        out.ended_at = time.monotonic()


def chat_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me a story"}],
        **extra,
    }


class Cluster:
    def __init__(self, tmp: Path, database_url: str, redis_url: str, procs: list[Proc]) -> None:
        self.tmp = tmp
        self.procs = procs
        self.prefix = f"dist{secrets.token_hex(3)}"
        self.keys = Keys(self.prefix)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.env = base_env(
            DATABASE_URL=database_url,
            REDIS_URL=redis_url,
            SECRET_KEY="distributed-test-secret-key-0123456789abcdef",
            MILLM_DATA_DIR=str(tmp / "data"),
            LOG_LEVEL="INFO",
            ENGINE_STREAM_PREFIX=self.prefix,
            ENGINE_HEARTBEAT_S=str(HEARTBEAT_S),
            ENGINE_DEAD_AFTER_S=str(DEAD_AFTER_S),
            ENGINE_SHUTDOWN_GRACE_S="3",
            MILLM_ENGINE_DEVICE="cpu",
            MILLM_ENGINE_DTYPE="float32",
            ENABLE_CONTINUOUS_BATCHING="true",
            MAX_CONCURRENT_REQUESTS="4",
            MAX_PENDING_REQUESTS="8",
            GRACEFUL_UNLOAD_TIMEOUT="5",
        )
        self.webs: dict[str, str] = {}

    def manage(self, *args: str, timeout_s: float = 180) -> str:
        result = subprocess.run(
            [PYTHON, str(REPO / "manage.py"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        assert result.returncode == 0, f"manage.py {args[0]} failed:\n{result.stderr[-3000:]}"
        return result.stdout

    def start(self, name: str, args: list[str]) -> Proc:
        proc = Proc(name, args, self.env, self.tmp)
        self.procs.append(proc)
        return proc

    def start_engine(self, name: str = "engine") -> Proc:
        return self.start(name, [PYTHON, str(REPO / "manage.py"), "run_engine"])

    def start_web(self, name: str) -> Proc:
        port = free_port()
        self.webs[name] = f"http://127.0.0.1:{port}"
        return self.start(
            name,
            [PYTHON, str(REPO / "manage.py"), "serve", "--host", "127.0.0.1", "--port", str(port), "--no-auto-load"],
        )

    def start_worker(self) -> Proc:
        return self.start(
            "worker",
            [
                CELERY,
                "-A",
                "millm_site",
                "worker",
                "-Q",
                "downloads,loads,maintenance",
                "--pool=prefork",
                "--concurrency=1",
                "--loglevel=INFO",
                "-n",
                f"{self.prefix}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
        )

    def heartbeat(self) -> dict[str, Any] | None:
        raw = self.redis.get(self.keys.heartbeat)
        return json.loads(raw) if raw else None

    def serving(self) -> dict[str, Any] | None:
        hb = self.heartbeat()
        return hb if hb and hb.get("phase") == "serving" else None

    def api(self, web: str, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.webs[web]}{path}", timeout=30, **kw)

    def live(self, web: str) -> bool:
        return self.api(web, "GET", "/api/health").status_code == 200


@pytest.fixture
def cluster(tmp_path, pg_database_url, redis_url, procs, tiny_assets) -> Cluster:
    c = Cluster(tmp_path, pg_database_url, redis_url, procs)
    c.manage("migrate", "--noinput")
    c.manage(
        "shell",
        "-c",
        textwrap.dedent(f"""
        from pathlib import Path
        from registry.services import demo_assets_install
        demo_assets_install(root=Path({str(asset_cache_dir())!r}), include_demo=False)
        """),
    )
    yield c
    c.redis.close()


def test_engine_and_web_crashes(cluster: Cluster, procs: list[Proc]):
    c = cluster
    engine = c.start_engine()
    c.start_web("web-a")
    c.start_web("web-b")
    c.start_worker()
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("both web servers", lambda: c.live("web-a") and c.live("web-b"), 60, procs)

    # --- load (a Celery job reaching the engine over Redis) and attach, through the API
    models = c.api("web-a", "GET", "/api/models").json()["data"]["models"]
    ids = {m["name"]: m["id"] for m in models}
    resp = c.api("web-a", "POST", f"/api/models/{ids['tiny-llama']}/load")
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["data"]["job"]["id"]
    wait_for(
        "the load job",
        lambda: c.api("web-b", "GET", f"/api/jobs/{job_id}").json()["data"]["status"] == "succeeded",
        90,
        procs,
    )
    assert c.serving()["status"]["model_id"] == "tiny-llama"
    saes = c.api("web-b", "GET", "/api/saes").json()["data"]["saes"]
    sae_id = next(s["id"] for s in saes if s["name"] == "tiny-llama-L1-relu")
    resp = c.api("web-b", "POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["data"]["layer_module_path"] == "model.layers.1"
    steer = {"steering": {"features": [{"index": 3, "strength": 8}]}}
    for web in ("web-a", "web-b"):
        resp = c.api(web, "POST", "/v1/chat/completions", json=chat_body(8, **steer))
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-miLLM-Steering"] != "none"
        assert resp.json()["millm"]["steering_apply_count"][0]["count"] > 0

    # --- a web process in distributed mode never imports torch
    probe = subprocess.run(
        [PYTHON, "-c", TORCH_FREE_PROBE], env=c.env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    assert report["statuses"] == [200, 200, 200, 200], report
    assert report["torch"] is False and report["transformers"] is False, report

    # ... nor do the running web servers and the Celery worker (and its forked child),
    # which have served requests and run a load by now; the engine does
    for proc in procs:
        assert proc.maps_library("libtorch") == (proc.name == "engine"), proc.name

    # --- kill -9 the engine while several clients stream
    outcomes = [Outcome() for _ in range(6)]
    threads = [
        threading.Thread(target=stream_chat, args=(c.webs["web-a" if i % 2 else "web-b"], chat_body(LONG), out))
        for i, out in enumerate(outcomes)
    ]
    for t in threads:
        t.start()
    wait_for(
        "two clients streaming", lambda: sum(o.first_token.is_set() for o in outcomes) >= 2, 60, procs, every_s=0.01
    )
    streaming = sum(o.first_token.is_set() and not o.finished for o in outcomes)
    engine.kill9()
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=ERROR_BOUND_S + 30)
    assert not any(t.is_alive() for t in threads), "a client hung after the engine died"
    assert streaming >= 2
    for out in outcomes:
        assert out.clean_error, (out, "\n".join(p.tail() for p in procs))
        assert out.ended_at - killed < ERROR_BOUND_S, out
        assert not out.finished, "a stream finished although the engine died under it"
    for web in ("web-a", "web-b"):
        resp = c.api(web, "POST", "/v1/chat/completions", json=chat_body(4))
        assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text
        assert resp.json()["error"]["code"] == "model_not_loaded"
        assert c.api(web, "GET", "/api/health/ready").status_code == 503

    # --- restart: the recorded model and attachment come back, requests succeed again
    c.start_engine("engine-2")
    hb = wait_for(
        "the restarted engine",
        lambda: (hb := c.serving()) and hb["status"]["model_id"] == "tiny-llama" and hb,
        120,
        procs,
    )
    assert [(a["sae_id"], a["layer"]) for a in hb["status"]["attachments"]] == [(sae_id, 1)]
    for web in ("web-a", "web-b"):
        out = Outcome()
        stream_chat(c.webs[web], chat_body(12, **steer), out)
        assert out.status == 200 and out.finished and out.done and out.error is None, out
        resp = c.api(web, "POST", "/v1/chat/completions", json=chat_body(6, **steer))
        assert resp.status_code == 200, resp.text
        assert resp.json()["millm"]["steering_apply_count"][0]["count"] > 0
    rows = c.api("web-a", "GET", "/api/saes/attachments").json()["data"]["entries"]
    assert [(a["sae_id"], a["layer"]) for a in rows] == [(sae_id, 1)]
    # the interrupted generations were given up (dead-letter stream), never run again
    dead = wait_for(
        "the dead-letter records",
        lambda: [json.loads(f["data"]) for _, f in c.redis.xrange(c.keys.dead_letter)],
        30,
        procs,
    )
    assert {d["reason"] for d in dead} == {"engine_died_while_running"}
    assert len(dead) >= streaming
    assert wait_for(
        "no pending work", lambda: int(c.redis.xpending(c.keys.requests, c.keys.group)["pending"]) == 0, 30, procs
    )

    # --- kill -9 a web server: its stream ends, its job still completes, the other serves
    lost = Outcome()
    lost_thread = threading.Thread(target=stream_chat, args=(c.webs["web-a"], chat_body(LONG), lost))
    lost_thread.start()
    wait_for("a stream on web-a", lost.first_token.is_set, 30, procs, every_s=0.01)

    def queue_b() -> dict[str, Any]:
        return c.api("web-b", "GET", "/api/health/inference").json()["data"]["queue"]

    # queue accounting is shared: web-b counts the slot web-a's stream holds
    assert queue_b()["in_flight"] >= 1
    assert c.api("web-a", "POST", f"/api/models/{ids['tiny-llama']}/unlock").status_code == 200
    resp = c.api("web-a", "POST", f"/api/models/{ids['tiny-gpt2']}/load")
    assert resp.status_code == 202, resp.text
    swap_job = resp.json()["data"]["job"]["id"]
    web_a = next(p for p in procs if p.name == "web-a")
    web_a.kill9()
    lost_thread.join(timeout=30)
    assert not lost_thread.is_alive()
    # the dead server's slot comes back once its lease lapses (2 x ENGINE_DEAD_AFTER_S)
    wait_for("web-a's slot to come back", lambda: queue_b()["in_flight"] == 0, 2 * DEAD_AFTER_S + 10, procs)
    job = wait_for(
        "the job web-a accepted",
        lambda: (
            (j := c.api("web-b", "GET", f"/api/jobs/{swap_job}").json()["data"])["status"] in ("succeeded", "failed")
            and j
        ),
        120,
        procs,
    )
    assert job["status"] == "succeeded", job
    wait_for("tiny-gpt2 resident", lambda: c.serving()["status"]["model_id"] == "tiny-gpt2", 30, procs)
    resp = c.api("web-b", "POST", "/v1/chat/completions", json={**chat_body(6), "model": "tiny-gpt2"})
    assert resp.status_code == 200, resp.text

    # --- SIGTERM: the engine stops cleanly and says so (no heartbeat left behind)
    engine_2 = next(p for p in procs if p.name == "engine-2")
    assert engine_2.terminate(timeout_s=30) == 0, engine_2.tail()
    assert c.heartbeat() is None


TORCH_FREE_PROBE = textwrap.dedent("""
    import asyncio, json, os, sys
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    import django
    django.setup()
    import httpx2 as httpx
    from millm_site.asgi import application

    async def main():
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=60) as client:
            body = {"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": "hi"}],
                    "steering": {"features": [{"index": 3, "strength": 8}]},
                    "return_sae_activations": {"top_k": 2, "positions": "last"}}
            statuses = []
            for method, path, payload in (
                    ("POST", "/v1/chat/completions", body),
                    ("POST", "/v1/chat/completions", {**body, "stream": True}),
                    ("GET", "/v1/models", None), ("GET", "/api/saes/attachments", None)):
                resp = await client.request(method, path, json=payload)
                statuses.append(resp.status_code)
        return statuses

    statuses = asyncio.run(main())
    print(json.dumps({"statuses": statuses, "torch": "torch" in sys.modules,
                      "transformers": "transformers" in sys.modules}))
""")
