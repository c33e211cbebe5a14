"""Feature dashboard runs on the Celery ``dashboards`` queue in distributed mode
(docs/features.md, "How a dashboard run works"; docs/deploy.md, the ``dashboarder``): the
topology as OS processes — ``run_engine``, a ``serve`` web process, a Celery worker for
loads and a dashboarder (``-Q dashboards``) — on a PostgreSQL and a Redis database of their
own.

- With no worker on the queue a run stays ``queued``, its task waiting in the broker's
  ``dashboards`` list (the web process does not run it).
- A dashboarder started then runs it to ``completed``: every context read, the feature
  pages answer from it, the dashboarder's log shows it ran the task and the web process's
  that it did not; the working folder under DASHBOARD_DIR is gone.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.conftest import Proc
from tests.distributed.test_analysis_queue import load_tiny_llama, start_celery
from tests.distributed.test_processes import Cluster, cluster, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

TASK = "features.tasks.dashboard_run_task"
TERMINAL = ("completed", "failed", "cancelled")
BUDGET, CONTEXT = 256, 32


def ran(proc: Proc, outcome: str) -> int:
    """Runs this worker finished with ``outcome`` (dashboard_run's return value), from its
    own log: Celery's success line names the task and its result."""
    text = proc.log_path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if TASK in line and "succeeded" in line and f"'{outcome}'" in line)


def run_get(c: Cluster, run_id: str) -> dict[str, Any]:
    resp = c.api("web", "GET", f"/api/dashboards/{run_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()["data"]


def test_a_dashboard_run_waits_for_and_runs_on_the_dashboards_queue(cluster: Cluster, procs: list[Proc]):  # noqa: F811
    c = cluster
    c.start_engine()
    web = c.start_web("web")
    start_celery(c, "loader", "loads")
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("the web server", lambda: c.live("web"), 60, procs)
    load_tiny_llama(c, procs)
    saes = c.api("web", "GET", "/api/saes").json()["data"]["saes"]
    sae_id = next(s["id"] for s in saes if s["name"] == "tiny-llama-L1-relu")
    resp = c.api("web", "POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert resp.status_code == 200, resp.text

    # --- no dashboarder: queued, its task in the broker's dashboards list
    body = {"corpus": "sample", "token_budget": BUDGET, "context_tokens": CONTEXT}
    resp = c.api("web", "POST", f"/api/saes/{sae_id}/dashboards", json=body)
    assert resp.status_code == 202, resp.text
    run = resp.json()["data"]["run"]
    assert run["status"] == "queued" and run["layer"] == 1, run
    wait_for("the task in the dashboards queue", lambda: c.redis.llen("dashboards") == 1, 30, procs)
    assert run_get(c, run["id"])["status"] == "queued"
    resp = c.api("web", "GET", f"/api/saes/{sae_id}/features/0")
    assert resp.status_code == 200 and resp.json()["data"]["dashboard"] is None, resp.text

    # --- a dashboarder started now runs it to the end
    dashboarder = start_celery(c, "dashboarder", "dashboards")
    done = wait_for("the run to end", lambda: (r := run_get(c, run["id"]))["status"] in TERMINAL and r, 180, procs)
    assert done["status"] == "completed" and done["complete"], done
    assert done["contexts_done"] == done["contexts_total"] == BUDGET // CONTEXT, done
    assert done["tokens_done"] == BUDGET == done["summary"]["tokens"], done
    wait_for("the dashboarder's success line", lambda: ran(dashboarder, "completed") == 1, 30, procs)
    assert "dashboard_run_start" not in web.log_path.read_text(errors="replace")  # the web process ran none
    assert not (c.tmp / "data" / "dashboards" / run["id"]).exists()

    # the feature pages answer from it: a feature that fired has its figures and contexts
    found = c.api("web", "GET", f"/api/saes/{sae_id}/features?limit=200").json()["data"]["features"]
    fired = [f for f in found if f["density"]]
    assert fired, found
    page = c.api("web", "GET", f"/api/saes/{sae_id}/features/{fired[0]['index']}").json()["data"]
    dash = page["dashboard"]
    assert page["run_id"] == run["id"] and dash["count"] > 0 and dash["top_contexts"] and dash["logit_top"], page
