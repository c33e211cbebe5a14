"""Analyses on the Celery ``analysis`` queue in distributed mode (docs/capture.md,
"Running them"): the topology as OS processes — ``run_engine``, a ``serve`` web process, a
Celery worker for loads and one for the ``analysis`` queue — on a PostgreSQL and a Redis
database of their own.

With the analysis worker running, a /v1 ``analyze`` (inline capture: its bytes are shipped)
and ``/api/captures/{id}/analyze`` (stored capture: its id is shipped, the worker reads the
file) answer with numbers equal to the test's own formulas on an independent float32
forward of the same checkpoint, and the worker's log shows it ran them (without torch).
With no worker on the queue the web process does not run them itself: the /v1 entry is
``analysis_unavailable`` after ``ANALYSIS_TIMEOUT_S`` and the stored-capture route is 503
``ANALYSIS_UNAVAILABLE``; a worker started again serves the next analysis.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.distributed.conftest import CELERY, Proc
from tests.distributed.test_processes import Cluster, cluster, wait_for  # noqa: F401
from tests.engine.test_capture import reference_blocks
from tests.engine.tolerances import ANALYSIS_ATOL, ANALYSIS_RTOL

pytestmark = pytest.mark.slow

PROMPT_IDS = [5, 17, 23, 42, 8, 11, 60, 3, 29, 14]
TIMEOUT_S = 4  # ANALYSIS_TIMEOUT_S of the processes
TASK = "monitoring.tasks.analysis_run_task"


def close(got, want) -> bool:
    return np.allclose(np.asarray(got, dtype=np.float64), want, atol=ANALYSIS_ATOL, rtol=ANALYSIS_RTOL)


def start_celery(c: Cluster, name: str, queues: str) -> Proc:
    return c.start(
        name,
        [
            CELERY,
            "-A",
            "millm_site",
            "worker",
            "-Q",
            queues,
            "--pool=prefork",
            "--concurrency=1",
            "--loglevel=INFO",
            "-n",
            f"{c.prefix}-{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
    )


def load_tiny_llama(c: Cluster, procs: list[Proc]) -> None:
    """Load tiny-llama through web's management API (a job of the ``loads`` worker) and
    wait for the job to succeed."""
    models = c.api("web", "GET", "/api/models").json()["data"]["models"]
    model_id = next(m["id"] for m in models if m["name"] == "tiny-llama")
    job = c.api("web", "POST", f"/api/models/{model_id}/load").json()["data"]["job"]["id"]
    wait_for(
        "the load job",
        lambda: c.api("web", "GET", f"/api/jobs/{job}").json()["data"]["status"] == "succeeded",
        120,
        procs,
    )


def ran_tasks(proc: Proc) -> int:
    """Analyses this worker finished, from its own log (Celery's success line)."""
    text = proc.log_path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if TASK in line and "succeeded" in line)


def assert_ran(proc: Proc, n: int, timeout_s: float = 10.0) -> None:
    """The worker's log says ``n`` analyses finished: Celery writes its success line after
    storing the result, so the web process may have the answer a moment before the line."""
    deadline = time.monotonic() + timeout_s
    while ran_tasks(proc) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ran_tasks(proc) == n


def completion(c: Cluster, **extra):
    body = {"model": "tiny-llama", "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    resp = c.api("web", "POST", "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_analyses_run_on_the_analysis_queue_and_nowhere_else(cluster: Cluster, procs, tiny_assets):  # noqa: F811
    c = cluster
    # two layers' rows stay inline (~10 kB), every layer's are stored (~19 kB)
    c.env.update(ANALYSIS_TIMEOUT_S=str(TIMEOUT_S), CAPTURE_INLINE_MAX_BYTES="12288")
    c.start_engine()
    c.start_web("web")
    start_celery(c, "loader", "loads")
    analyst = start_celery(c, "analyst", "analysis")
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("the web server", lambda: c.live("web"), 60, procs)
    load_tiny_llama(c, procs)
    wait_for("the analysis worker", lambda: "ready" in analyst.log_path.read_text(), 60, procs)

    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32, local_files_only=True).eval()
    p = len(PROMPT_IDS)

    # --- /v1, inline capture: the worker gets its bytes (the capture asked for too, so the
    # response names the generated tokens the reference needs)
    got = completion(
        c,
        capture={"layers": [0], "positions": "last"},
        analyze={"name": "hidden_states", "params": {"layers": [2], "reduce": "norm", "positions": "prompt"}},
    )
    assert got["millm"]["capture"]["inline"] is True
    ids = PROMPT_IDS + got["millm"]["capture"]["metadata"]["completion_token_ids"][:-1]
    ref = reference_blocks(asset, model, ids)
    (entry,) = got["millm"]["analysis"]
    assert "result" in entry, entry
    assert close(entry["result"]["layers"]["2"], np.linalg.norm(ref[2][:p]))
    assert not close(entry["result"]["layers"]["2"], np.linalg.norm(ref[1][:p]))  # another layer
    assert_ran(analyst, 1)

    # --- a stored capture, analyzed with the /v1 request and again through /api/captures
    got = completion(
        c,
        capture={"layers": [0, 1, 2, 3], "positions": "all"},
        analyze={"name": "hidden_states", "params": {"layers": [3], "reduce": "mean", "positions": "completion"}},
    )
    capture = got["millm"]["capture"]
    assert capture["inline"] is False
    (entry,) = got["millm"]["analysis"]
    assert entry["capture_id"] == capture["id"]
    assert close(entry["result"]["layers"]["3"], ref[3][p - 1 :].mean(axis=0))
    resp = c.api(
        "web",
        "POST",
        f"/api/captures/{capture['id']}/analyze",
        json={"name": "hidden_states", "params": {"layers": [1], "reduce": "last", "positions": "all"}},
    )
    assert resp.status_code == 200, resp.text
    assert close(resp.json()["data"]["result"]["layers"]["1"], ref[1][-1])
    # a refusal where the analysis runs comes back as the documented error
    resp = c.api(
        "web",
        "POST",
        f"/api/captures/{capture['id']}/analyze",
        json={
            "name": "attention_tracker",
            "params": {"layer_heads": {"1": [0]}, "instruction": [0, 2], "data": [2, 4]},
        },
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "ANALYZER_CAPTURE_MISSING"
    assert_ran(analyst, 4)
    assert not analyst.maps_library("libtorch")  # the worker runs numpy, never torch

    # --- no worker on the queue: the web process does not run the analysis itself
    analyst.terminate()
    started = time.monotonic()
    got = completion(c, analyze={"name": "hidden_states", "params": {"layers": [2], "reduce": "norm"}})
    assert time.monotonic() - started >= TIMEOUT_S
    (entry,) = got["millm"]["analysis"]
    assert "result" not in entry and entry["error"]["code"] == "analysis_unavailable", entry
    assert got["choices"][0]["text"]  # the generation itself is answered
    resp = c.api(
        "web",
        "POST",
        f"/api/captures/{capture['id']}/analyze",
        json={"name": "hidden_states", "params": {"layers": [1], "reduce": "norm"}},
    )
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "ANALYSIS_UNAVAILABLE"

    # --- a worker back on the queue serves the next one (the expired ones are not run)
    again = start_celery(c, "analyst-2", "analysis")
    wait_for("the second analysis worker", lambda: "ready" in again.log_path.read_text(), 60, procs)
    resp = c.api(
        "web",
        "POST",
        f"/api/captures/{capture['id']}/analyze",
        json={"name": "hidden_states", "params": {"layers": [2], "reduce": "norm", "positions": "prompt"}},
    )
    assert resp.status_code == 200, resp.text
    assert close(resp.json()["data"]["result"]["layers"]["2"], np.linalg.norm(ref[2][:p]))
    assert_ran(again, 1)
