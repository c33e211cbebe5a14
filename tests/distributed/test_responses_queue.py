"""Background responses on the Celery ``responses`` queue in distributed mode (docs/api-v1.md,
"Responses API", Background; docs/deploy.md, the ``responder``): the topology as OS
processes — ``run_engine`` (held_engine.py: a generation waits at its ``HOLD_AT``-th token
while the test's Redis key exists), a ``serve`` web process, a Celery worker for loads and a
responder (``-Q responses``) — on a PostgreSQL and a Redis database of their own.

- With the responder running, ``POST /v1/responses`` with ``background: true`` answers
  ``queued`` and ends with the synchronous answer of the same greedy request (same text,
  same status, same usage), under its own id; the responder's log shows it ran the task,
  the web process's that it did not.
- A cancel while the engine holds the generation ends it ``cancelled`` with no output, the
  run ends (the engine's job with it) and the engine answers the next request.
- With no worker on the queue the response stays ``queued``, its task waiting in the
  broker's ``responses`` list (the web process does not run it); a responder started then
  answers it as the synchronous request.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.conftest import PYTHON, REPO, Proc
from tests.distributed.held_engine import HOLD_AT
from tests.distributed.test_analysis_queue import load_tiny_llama, start_celery
from tests.distributed.test_processes import Cluster, cluster, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

HELD_ENGINE = REPO / "tests" / "distributed" / "held_engine.py"
TASK = "inference.tasks.response_run_task"
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
GREEDY = {"model": "tiny-llama", "temperature": 0, "max_output_tokens": 8}


def output_text(body: dict[str, Any]) -> str:
    """The text of a Response's message items (what the openai client's ``output_text`` is)."""
    return "".join(
        part["text"]
        for item in body["output"]
        if item.get("type") == "message"
        for part in item["content"]
        if part.get("type") == "output_text"
    )


def create(c: Cluster, **body: Any) -> dict[str, Any]:
    resp = c.api("web", "POST", "/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def retrieve(c: Cluster, response_id: str) -> dict[str, Any]:
    resp = c.api("web", "GET", f"/v1/responses/{response_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def ran(proc: Proc, outcome: str) -> int:
    """Runs this worker finished with ``outcome`` (response_run's return value), from its
    own log: Celery's success line names the task and its result."""
    text = proc.log_path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if TASK in line and "succeeded" in line and f"'{outcome}'" in line)


def engine_pending(c: Cluster) -> int:
    """Generations the engine has taken and not finished (its consumer group's pending)."""
    return int(c.redis.xpending(c.keys.requests, c.keys.group)["pending"])


def test_background_responses_run_on_the_responses_queue(cluster: Cluster, procs: list[Proc]):  # noqa: F811
    c = cluster
    hold = f"{c.prefix}:test-hold"
    c.env["MILLM_TEST_HOLD_KEY"] = hold
    c.start("engine", [PYTHON, str(HELD_ENGINE)])
    web = c.start_web("web")
    start_celery(c, "loader", "loads")
    responder = start_celery(c, "responder", "responses")
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("the web server", lambda: c.live("web"), 60, procs)
    load_tiny_llama(c, procs)
    wait_for("the responder", lambda: "ready" in responder.log_path.read_text(), 60, procs)

    # --- the responder runs it: queued, then the synchronous answer under its own id
    sync = create(c, input="Once upon a time", **GREEDY)
    assert sync["status"] in ("completed", "incomplete") and output_text(sync), sync
    queued = create(c, input="Once upon a time", background=True, **GREEDY)
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == [], queued
    done = wait_for(
        "the background response",
        lambda: (r := retrieve(c, queued["id"]))["status"] in TERMINAL and r,
        120,
        procs,
    )
    assert done["status"] == sync["status"], done
    assert output_text(done) == output_text(sync)
    assert done["usage"]["output_tokens"] == sync["usage"]["output_tokens"]
    assert done["id"] == queued["id"] and done["created_at"] == queued["created_at"] and done["background"]
    wait_for("the responder's success line", lambda: ran(responder, sync["status"]) == 1, 30, procs)
    assert "response_run_start" not in web.log_path.read_text(errors="replace")  # the web process ran none

    # --- cancel while the engine holds the generation at its HOLD_AT-th token
    c.redis.set(hold, "1")
    held = create(c, input="Hold me", background=True, **{**GREEDY, "max_output_tokens": 4 * HOLD_AT})
    wait_for("the held generation at the engine", lambda: engine_pending(c) == 1, 60, procs)
    assert retrieve(c, held["id"])["status"] == "in_progress"
    resp = c.api("web", "POST", f"/v1/responses/{held['id']}/cancel")
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled", resp.text
    # the runner sees the cancel at its next heartbeat and cancels the engine's job, which
    # ends although the hold is still on
    wait_for("the run to end cancelled", lambda: ran(responder, "cancelled") == 1, 30, procs)
    wait_for("the engine to let the generation go", lambda: engine_pending(c) == 0, 30, procs)
    c.redis.delete(hold)
    got = retrieve(c, held["id"])
    assert got["status"] == "cancelled" and got["output"] == [] and got.get("usage") is None, got
    after = create(c, input="Once upon a time", **GREEDY)
    assert output_text(after) == output_text(sync)  # the engine and its slots are free

    # --- no worker on the queue: the response stays queued, its task in the broker
    assert responder.terminate() == 0, responder.tail()
    waiting = create(c, input="Once upon a time", background=True, **GREEDY)
    assert waiting["status"] == "queued"
    wait_for("the task in the responses queue", lambda: c.redis.llen("responses") == 1, 30, procs)
    assert retrieve(c, waiting["id"])["status"] == "queued"
    assert "response_run_start" not in web.log_path.read_text(errors="replace")

    # --- a responder started now answers it
    again = start_celery(c, "responder-2", "responses")
    done = wait_for(
        "the waiting response",
        lambda: (r := retrieve(c, waiting["id"]))["status"] in TERMINAL and r,
        120,
        procs,
    )
    assert done["status"] == sync["status"] and output_text(done) == output_text(sync), done
    wait_for("the new responder's success line", lambda: ran(again, sync["status"]) >= 1, 30, procs)
    wait_for("an empty responses queue", lambda: c.redis.llen("responses") == 0, 30, procs)
