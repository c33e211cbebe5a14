"""SAE fidelity across keys (docs/security.md, "Experiments"), against the live daphne of
tests/v1 with three keys: alice and bob hold inference keys, root an admin key. Alice
uploads a corpus through the official ``openai`` client and her corpus fidelity run over
it completes on the engine; then every attack bob (or a caller with no key) can make is
sent over HTTP and the test checks that nothing happened: her file and run are 404 for
him and no run of his is created, the figures of her file never reach him through the
SAE's fidelity route (a run over the shared sample does), an unknown or detached SAE and
oversized or malformed bodies are refused before anything is created."""

from __future__ import annotations

import io
import json

import pytest

from experiments.models import ExperimentRun
from tests.experiments.conftest import sae  # noqa: F401 - fixture (tiny-llama with its L1 SAE; every run ended after)
from tests.security import across_keys
from tests.security.across_keys import answer, call
from tests.v1.conftest import KEYS, _v1_db, keyed, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

WORDS = "quartz lantern orbit velvet meadow harbor pepper falcon ribbon copper glacier violet".split()


def wait_ended(server, who: str, run_id: str, timeout_s: float = 240) -> dict:
    return across_keys.wait_ended(server, who, f"/api/experiments/{run_id}", timeout_s)


def test_one_keys_corpus_fidelity_is_a_404_for_another_and_never_shown(llama, sae, keyed):  # noqa: F811
    server = llama
    lines = [json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) for i in range(len(WORDS))]
    upload = keyed["alice"].files.create(file=("corpus.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    body = {"sae_id": sae.id, "corpus": "file", "file_id": upload.id, "token_budget": 128, "context_tokens": 16}

    # bob's run over alice's file: 404 naming it, and no run of his
    error = answer(call(server, "bob", "POST", "/api/experiments/fidelity", body), 404, "FILE_NOT_FOUND")
    assert upload.id in error["message"]
    assert ExperimentRun.objects.count() == 0

    run = answer(call(server, "alice", "POST", "/api/experiments/fidelity", body), 202)["run"]
    done = wait_ended(server, "alice", run["id"])
    assert done["status"] == "completed", done
    figures = done["result"]
    assert figures["rows"] > 0 and figures["loss_recovered_unavailable"] is None

    # bob: her run is a 404 (read, points, download, cancel), never listed; nothing changes
    for method, path in (
        ("GET", f"/api/experiments/{run['id']}"),
        ("GET", f"/api/experiments/{run['id']}/points"),
        ("GET", f"/api/experiments/{run['id']}/download?format=jsonl"),
        ("POST", f"/api/experiments/{run['id']}/cancel"),
    ):
        answer(call(server, "bob", method, path), 404, "EXPERIMENT_NOT_FOUND")
    assert answer(call(server, "bob", "GET", "/api/experiments?kind=fidelity"), 200) == {"runs": [], "total": 0}
    assert ExperimentRun.objects.get(id=run["id"]).status == "completed"

    # the figures over her file never reach him through the SAE's fidelity
    shown = answer(call(server, "bob", "GET", f"/api/saes/{sae.id}/fidelity"), 200)
    assert (shown["run_id"], shown["fidelity"]) == (None, None)
    # the positive controls: alice and the admin read it
    for who in ("alice", "root"):
        mine = answer(call(server, who, "GET", f"/api/saes/{sae.id}/fidelity"), 200)
        assert mine["run_id"] == run["id"] and mine["fidelity"] == figures

    # a run over the shared sample is everyone's figures (its run is still its owner's)
    sample = {"sae_id": sae.id, "token_budget": 64, "context_tokens": 16}
    other = answer(call(server, "alice", "POST", "/api/experiments/fidelity", sample), 202)["run"]
    assert wait_ended(server, "alice", other["id"])["status"] == "completed"
    assert answer(call(server, "bob", "GET", f"/api/saes/{sae.id}/fidelity"), 200)["run_id"] == other["id"]
    answer(call(server, "bob", "GET", f"/api/experiments/{other['id']}"), 404, "EXPERIMENT_NOT_FOUND")


def test_no_key_unknown_saes_and_bad_bodies_create_nothing(llama, sae, keyed, settings):  # noqa: F811
    server = llama
    good = {"sae_id": sae.id, "token_budget": 64}
    # no key: 401 on every route, /v1's monitoring too
    assert call(server, None, "POST", "/api/experiments/fidelity", good)[0] == 401
    assert call(server, None, "GET", f"/api/saes/{sae.id}/fidelity")[0] == 401
    v1 = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "monitoring": {"fidelity": True}}
    assert request(server.base_url, "POST", "/completions", v1).status == 401
    # an unknown SAE: 404 (start and read); one registered but not attached: 409
    answer(
        call(server, "alice", "POST", "/api/experiments/fidelity", {**good, "sae_id": "sae_nope"}), 404, "SAE_NOT_FOUND"
    )
    answer(call(server, "alice", "GET", "/api/saes/sae_nope/fidelity"), 404, "SAE_NOT_FOUND")
    from registry.models import SAE as SAERow

    detached = SAERow.objects.get(name="tiny-llama-L3-relu")
    error = answer(
        call(server, "alice", "POST", "/api/experiments/fidelity", {**good, "sae_id": detached.id}),
        409,
        "SAE_NOT_ATTACHED",
    )
    assert error["details"]["param"] == "sae_id"
    # a layer it is not attached at: 409 naming layer
    error = answer(
        call(server, "alice", "POST", "/api/experiments/fidelity", {**good, "layer": 3}), 409, "SAE_NOT_ATTACHED"
    )
    assert error["details"]["param"] == "layer"
    # a 10 MB body: 413 before anything is read
    big = json.dumps({**good, "text_field": "x" * (10 * 2**20)}).encode()
    resp = request(
        server.url, "POST", "/api/experiments/fidelity", raw=big, headers={"Authorization": f"Bearer {KEYS['alice']}"}
    )
    assert resp.status == 413 and resp.json()["error"]["code"] == "PAYLOAD_TOO_LARGE", resp.body[:300]
    # over the budget cap, a path-like field name, a threshold out of range, a file with
    # the sample, a file corpus with no file: 422 naming the field
    for bad, field in (
        ({**good, "token_budget": settings.DASHBOARD_MAX_TOKENS + 1}, "token_budget"),
        ({**good, "corpus": "file", "file_id": "file-x", "text_field": "../../etc/passwd"}, "text_field"),
        ({**good, "dense_threshold": 0}, "dense_threshold"),
        ({**good, "dense_threshold": 2}, "dense_threshold"),
        ({**good, "file_id": "file-x"}, "file_id"),
        ({**good, "corpus": "file"}, "file_id"),
        ({**good, "context_tokens": 100_000}, "context_tokens"),
        ({**good, "sae_id": "../../etc"}, "sae_id"),
    ):
        error = answer(call(server, "alice", "POST", "/api/experiments/fidelity", bad), 422, "VALIDATION_ERROR")
        assert field in json.dumps(error["details"]), (field, error)
    assert call(server, "alice", "GET", f"/api/saes/{sae.id}/fidelity?layer=-1")[0] == 422
    assert ExperimentRun.objects.count() == 0
