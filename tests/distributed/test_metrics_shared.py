"""One set of metrics for a stack of several processes (issue 37, part 5): two
``manage.py serve`` workers, a Celery worker and ``manage.py run_engine`` on PostgreSQL
and Redis of their own.

- Requests answered by worker A and by worker B are counted once each, and either worker
  (and a third one started later, after B has stopped) reports their sum — in
  /api/health/metrics and in the Prometheus text — never less than it reported before.
- So are the slots each worker's admission controller gave (``queue.admitted_total``).
- The load the Celery worker ran is counted in what the web workers report.
- While a stream is held at the engine (``held_engine.py``), the engine's figures say one
  row of the batch runs (occupancy = 1 ÷ the rows it may run), with KV bytes held and
  decode steps timed; once it ends the row is free and the tokens it generated are
  counted.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

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

HELD_ENGINE = REPO / "tests" / "distributed" / "held_engine.py"
CHAT_ROUTE = {"surface": "v1", "route": "v1/chat/completions", "method": "POST", "code": "200"}


def _json(c: Cluster, web: str) -> dict[str, Any]:
    resp = c.api(web, "GET", "/api/health/metrics")
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


def _prometheus(c: Cluster, web: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = c.api(web, "GET", "/api/health/metrics/prometheus")
    assert resp.status_code == 200, resp.text
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Readings:
    """Every figure read, in order, from whichever worker: none may go down."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.seen: list[tuple[str, float, float, float]] = []

    def read(self, web: str) -> tuple[float, float, float]:
        data = _json(self.c, web)
        prom = _prometheus(self.c, web)
        chats = _sample(prom, "millm_http_requests_total", **CHAT_ROUTE)
        figures = (chats, float(data["tokens_generated"]), float(data["requests"]["total"]))
        if self.seen:
            previous = self.seen[-1][1:]
            assert all(now >= before for now, before in zip(figures, previous, strict=True)), (
                f"{web} reported {figures} after {previous}: {self.seen}"
            )
        self.seen.append((web, *figures))
        return figures


def test_counters_sum_over_web_workers_and_the_engine_reports_its_batch(
    cluster: Cluster,  # noqa: F811
    procs: list[Proc],
):
    c = cluster
    hold = f"{c.prefix}:test-hold"
    reached = c.tmp / "hold-reached"
    c.env["MILLM_TEST_HOLD_KEY"] = hold
    c.env["MILLM_TEST_HOLD_REACHED"] = str(reached)
    c.env["METRICS_FLUSH_INTERVAL_S"] = "0.2"
    c.start("engine", [PYTHON, str(HELD_ENGINE)])
    c.start_web("web-a")
    web_b = c.start_web("web-b")
    c.start_worker()
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("both web servers", lambda: c.live("web-a") and c.live("web-b"), 60, procs)

    # --- requests on both workers (the first loads the model, through Celery)
    sent = {"web-a": 3, "web-b": 2}
    completion = 0
    for web, n in sent.items():
        for _ in range(n):
            resp = c.api(web, "POST", "/v1/chat/completions", json=chat_body(4))
            assert resp.status_code == 200, resp.text
            completion += resp.json()["usage"]["completion_tokens"]
    assert completion == 4 * sum(sent.values())

    readings = Readings(c)
    total_chats = float(sum(sent.values()))
    for web in ("web-a", "web-b"):
        # each worker's own requests are in at once, the other's within its flush interval
        wait_for(
            f"{web} to report both workers' requests",
            lambda web=web: readings.read(web)[:2] == (total_chats, float(completion)),
            30,
            procs,
            every_s=0.05,
        )
    for web in ("web-a", "web-b", "web-a", "web-b"):
        chats, tokens, _ = readings.read(web)
        assert (chats, tokens) == (total_chats, completion)

    # the histogram is summed too: one observation per counted request, on every worker
    for web in ("web-a", "web-b"):
        prom = _prometheus(c, web)
        requests_v1 = sum(
            v
            for (name, labels), v in prom.items()
            if name == "millm_http_requests_total" and ("surface", "v1") in labels
        )
        count = _sample(prom, "millm_http_request_duration_seconds_count", surface="v1")
        assert count == requests_v1 >= total_chats
        assert _sample(prom, "millm_http_request_duration_seconds_bucket", surface="v1", le="+Inf") == count

    # each worker's admission controller gave its own requests their slots: both say five
    for web in ("web-a", "web-b"):
        wait_for(
            f"{web} to count both workers' admissions",
            lambda web=web: _json(c, web)["queue"]["admitted_total"] == total_chats,
            30,
            procs,
        )
        assert _sample(_prometheus(c, web), "millm_admission_admitted_total") == total_chats

    # the load ran in the Celery worker; the web workers count it
    for web in ("web-a", "web-b"):
        wait_for(
            f"{web} to count the Celery worker's load",
            lambda web=web: _json(c, web)["model_loads"].get("succeeded") == 1,
            30,
            procs,
        )

    # a worker that stops takes nothing with it; one that starts later reports the sums
    web_b.terminate()
    c.start_web("web-c")
    wait_for("web-c", lambda: c.live("web-c"), 60, procs)
    chats, tokens, _ = readings.read("web-c")
    assert (chats, tokens) == (total_chats, completion)

    # --- the engine's batch while one stream is held there
    before = _json(c, "web-a")["engines"]
    assert [e["engine"] for e in before] == ["default"]
    assert before[0]["running"] == 0 and before[0]["occupancy"] == 0
    assert before[0]["generated_tokens_total"] == completion
    c.redis.set(hold, "1")
    out = Outcome()
    streamer = threading.Thread(target=stream_chat, args=(c.webs["web-a"], chat_body(40), out, 180))
    streamer.start()
    wait_for("the stream to be held at the engine", reached.exists, 60, procs, every_s=0.02)

    def running() -> dict[str, Any] | None:
        engine = _json(c, "web-c")["engines"][0]
        return engine if engine["running"] == 1 else None

    engine = wait_for("the engine's figures to show the held row", running, 30, procs)
    assert engine["max_rows"] >= 1
    assert engine["occupancy"] == pytest.approx(1 / engine["max_rows"], abs=1e-6)
    assert 0 < engine["kv_bytes_in_use"] <= engine["kv_capacity_bytes"]
    assert engine["decode_steps"] > before[0]["decode_steps"]
    assert engine["step_seconds_last"] > 0 and engine["decode_seconds_total"] > before[0]["decode_seconds_total"]
    prom = _prometheus(c, "web-c")
    assert _sample(prom, "millm_engine_running_rows", engine="default") == 1
    assert _sample(prom, "millm_engine_max_rows", engine="default") == engine["max_rows"]
    assert _sample(prom, "millm_engine_kv_bytes_in_use", engine="default") > 0
    assert not out.ended_at, "the held stream ended early"

    c.redis.delete(hold)
    streamer.join(180)
    assert out.status == 200 and out.finished and out.done and out.error is None, out

    def idle() -> dict[str, Any] | None:
        engine = _json(c, "web-a")["engines"][0]
        return engine if engine["running"] == 0 else None

    engine = wait_for("the row to be free again", idle, 30, procs)
    assert engine["occupancy"] == 0 and engine["kv_bytes_in_use"] == 0
    assert engine["generated_tokens_total"] == completion + 40
