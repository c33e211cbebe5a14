"""Feature dashboards across keys (docs/security.md, "Feature dashboards"), against the live
daphne of tests/v1 with three keys: alice and bob hold inference keys, root an admin key.
Alice uploads a corpus through the official ``openai`` client and her run over it goes to
completion on the engine; then every attack bob can make is sent over HTTP and the test
checks that nothing happened: her file and run are 404 for him (and no run of his is
created), her file's text never reaches him through a feature page or search, and a 10 MB
body is refused before anything is created."""

from __future__ import annotations

import io
import json
import time
from urllib.parse import quote

import pytest

from features.models import DashboardRun, FeatureDashboard
from tests.security import across_keys
from tests.security.across_keys import answer, call
from tests.v1.conftest import KEYS, _v1_db, attach, keyed, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

SAE = "tiny-llama-L1-relu"
WORDS = "quartz lantern orbit velvet meadow harbor pepper falcon ribbon copper glacier violet".split()


@pytest.fixture
def dashboards(llama, settings, tmp_path):
    """tiny-llama resident with the L1 SAE attached at layer 1; every run ended after."""
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    sae = attach(SAE, 1)
    yield sae
    for run in DashboardRun.objects.exclude(status__in=DashboardRun.TERMINAL):
        from features.services import dashboard_cancel

        dashboard_cancel(run_id=run.id, principal=_admin())
    deadline = time.monotonic() + 60
    while DashboardRun.objects.exclude(status__in=DashboardRun.TERMINAL).exists():
        assert time.monotonic() < deadline, "a dashboard runner did not end"
        time.sleep(0.05)


def _admin():
    from core.auth import ANONYMOUS

    return ANONYMOUS


def wait_ended(server, run_id: str, timeout_s: float = 180) -> dict:
    return across_keys.wait_ended(server, "alice", f"/api/dashboards/{run_id}", timeout_s)


def test_one_keys_corpus_and_run_are_a_404_for_another_and_never_shown(llama, dashboards, keyed):  # noqa: F811
    server, sae = llama, dashboards
    lines = [json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) for i in range(len(WORDS))]
    upload = keyed["alice"].files.create(file=("corpus.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    body = {"corpus": "file", "file_id": upload.id, "token_budget": 256, "context_tokens": 16}

    # bob's run over alice's file: 404 naming it, and no run of his
    error = answer(call(server, "bob", "POST", f"/api/saes/{sae.id}/dashboards", body), 404, "FILE_NOT_FOUND")
    assert upload.id in error["message"]
    assert DashboardRun.objects.count() == 0

    run = answer(call(server, "alice", "POST", f"/api/saes/{sae.id}/dashboards", body), 202)["run"]
    done = wait_ended(server, run["id"])
    assert (done["status"], done["complete"]) == ("completed", True), done
    stored = FeatureDashboard.objects.filter(run_id=run["id"])
    assert stored.exists()

    # a word-piece of alice's text at a feature's strongest position (the test's own pick)
    def at_max(r: FeatureDashboard) -> str:
        ctx = r.top_contexts[0] if r.top_contexts else None
        return ctx["tokens"][ctx["max_position"]].strip() if ctx else ""

    row = max((r for r in stored if at_max(r).isalpha()), key=lambda r: r.max)
    index, secret = row.index, quote(at_max(row))

    # bob: her run is a 404 (read and cancel), never listed; nothing changes
    answer(call(server, "bob", "GET", f"/api/dashboards/{run['id']}"), 404, "DASHBOARD_NOT_FOUND")
    answer(call(server, "bob", "POST", f"/api/dashboards/{run['id']}/cancel"), 404, "DASHBOARD_NOT_FOUND")
    assert answer(call(server, "bob", "GET", f"/api/saes/{sae.id}/dashboards"), 200) == {"runs": [], "total": 0}
    assert DashboardRun.objects.get(id=run["id"]).status == "completed"

    # her file's text never reaches him through the figures
    page = answer(call(server, "bob", "GET", f"/api/saes/{sae.id}/features/{index}"), 200)
    assert (page["dashboard"], page["run_id"]) == (None, None)
    assert answer(call(server, "bob", "GET", f"/api/saes/{sae.id}/features?token={secret}"), 200)["total"] == 0
    # the positive control: alice (and the admin) read it
    mine = answer(call(server, "alice", "GET", f"/api/saes/{sae.id}/features/{index}"), 200)
    assert mine["run_id"] == run["id"] and mine["dashboard"]["max"] == pytest.approx(row.max)
    assert answer(call(server, "root", "GET", f"/api/saes/{sae.id}/features/{index}"), 200)["run_id"] == run["id"]
    found = answer(call(server, "alice", "GET", f"/api/saes/{sae.id}/features?token={secret}"), 200)
    assert index in [f["index"] for f in found["features"]]


def test_a_10_mb_body_and_a_budget_over_the_cap_create_nothing(llama, dashboards, keyed, settings):  # noqa: F811
    server, sae = llama, dashboards
    big = json.dumps({"corpus": "sample", "token_budget": 64, "text_field": "x" * (10 * 2**20)}).encode()
    resp = request(
        server.url,
        "POST",
        f"/api/saes/{sae.id}/dashboards",
        raw=big,
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
    )
    assert resp.status == 413 and resp.json()["error"]["code"] == "PAYLOAD_TOO_LARGE", resp.body[:300]
    over = {"corpus": "sample", "token_budget": settings.DASHBOARD_MAX_TOKENS + 1}
    error = answer(call(server, "alice", "POST", f"/api/saes/{sae.id}/dashboards", over), 422, "VALIDATION_ERROR")
    assert "DASHBOARD_MAX_TOKENS" in json.dumps(error)
    path_like = {"corpus": "sample", "token_budget": 64, "text_field": "../../etc/passwd"}
    answer(call(server, "alice", "POST", f"/api/saes/{sae.id}/dashboards", path_like), 422, "VALIDATION_ERROR")
    assert DashboardRun.objects.count() == 0
    # no key: 401 before anything
    resp = request(server.url, "POST", f"/api/saes/{sae.id}/dashboards", {"corpus": "sample", "token_budget": 64})
    assert resp.status == 401
    assert DashboardRun.objects.count() == 0
