"""Per-key quotas (``KEY_LIMITS``, docs/operators.md "Quotas and usage") across two real
``manage.py serve`` processes of the distributed topology, on a PostgreSQL and a Redis
database of their own, with ``run_engine`` (held_engine.py: a generation waits at its
``HOLD_AT``-th token while the test's Redis key exists) and a Celery worker for the load.

alice may send 3 requests a minute: her requests, spread over both web processes, are
answered until the third; the fourth and fifth get OpenAI's 429 ``rate_limit_exceeded``
with Retry-After, whichever process answers, while bob (no limit) is served by both.
carol may run one request at once: while her stream is held at the engine on one web
process, her request to the other is refused the same way; once it ends, the place is
free in both."""

from __future__ import annotations

import json
import threading

import pytest

from tests.distributed.conftest import PYTHON, REPO, Proc
from tests.distributed.held_engine import HOLD_AT
from tests.distributed.test_analysis_queue import start_celery
from tests.distributed.test_processes import Cluster, Outcome, chat_body, cluster, stream_chat, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

HELD_ENGINE = REPO / "tests" / "distributed" / "held_engine.py"
KEYS = {"alice": "sk-alice-quota-0123", "bob": "sk-bob-quota-0123", "carol": "sk-carol-quota-0123"}
ROOT = "sk-root-quota-0123"
RPM = 3


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name] if name in KEYS else ROOT}"}


def _chat(c: Cluster, web: str, who: str, max_tokens: int = 4):
    return c.api(web, "POST", "/v1/chat/completions", json=chat_body(max_tokens), headers=_auth(who))


def _refused(resp) -> dict:
    """The 429 in OpenAI's shape, its Retry-After a positive whole number of seconds."""
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["code"] == "rate_limit_exceeded", error
    assert int(resp.headers["retry-after"]) >= 1, resp.headers
    return error


def test_key_quotas_hold_across_two_serve_processes(cluster: Cluster, procs: list[Proc]):  # noqa: F811
    c = cluster
    hold = f"{c.prefix}:test-hold"
    reached = c.tmp / "hold-reached"
    c.env.update(
        MILLM_API_KEYS=",".join(f"{name}:{secret}" for name, secret in KEYS.items()),
        MILLM_ADMIN_API_KEYS=f"root:{ROOT}",
        KEY_LIMITS=json.dumps({"alice": {"rpm": RPM}, "carol": {"concurrent": 1}}),
        MILLM_TEST_HOLD_KEY=hold,
        MILLM_TEST_HOLD_REACHED=str(reached),
        # no crash is tested here: a busy machine's slow heartbeat must not read as a dead engine
        ENGINE_HEARTBEAT_S="0.5",
        ENGINE_DEAD_AFTER_S="30",
    )
    c.start("engine", [PYTHON, str(HELD_ENGINE)])
    c.start_web("web-a")
    c.start_web("web-b")
    start_celery(c, "loader", "loads")
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("both web servers", lambda: c.live("web-a") and c.live("web-b"), 60, procs)
    models = c.api("web-a", "GET", "/api/models", headers=_auth("root")).json()["data"]["models"]
    model_id = next(m["id"] for m in models if m["name"] == "tiny-llama")
    resp = c.api("web-a", "POST", f"/api/models/{model_id}/load", headers=_auth("root"))
    assert resp.status_code == 202, resp.text
    job = resp.json()["data"]["job"]["id"]
    wait_for(
        "the load job",
        lambda: (
            c.api("web-b", "GET", f"/api/jobs/{job}", headers=_auth("root")).json()["data"]["status"] == "succeeded"
        ),
        120,
        procs,
    )

    # --- requests per minute: alice's minute is one, whichever process she reaches
    for web in ("web-a", "web-b", "web-a")[:RPM]:
        resp = _chat(c, web, "alice")
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    for web in ("web-b", "web-a"):
        resp = _chat(c, web, "alice")
        error = _refused(resp)
        assert f"Limit {RPM}, Used {RPM}" in error["message"], error
        assert resp.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(resp.headers["retry-after"]) <= 60
    # another key's window: bob has no limit and is served by both
    for web in ("web-a", "web-b"):
        assert _chat(c, web, "bob").status_code == 200

    # --- requests at once: carol's one place is taken on web-a, refused on web-b
    c.redis.set(hold, "1")
    held = Outcome()
    thread = threading.Thread(
        target=stream_chat, args=(c.webs["web-a"], chat_body(2 * HOLD_AT), held, 120, _auth("carol"))
    )
    thread.start()
    try:
        wait_for("carol's stream held at the engine", reached.exists, 60, procs)
        for web in ("web-b", "web-a"):
            error = _refused(_chat(c, web, "carol"))
            assert "requests at once" in error["message"], error
    finally:
        c.redis.delete(hold)
        thread.join(timeout=120)
    assert held.status == 200 and held.finished and held.done and held.error is None, held
    # its place came back: carol is served again, on the other process
    assert _chat(c, "web-b", "carol").status_code == 200
