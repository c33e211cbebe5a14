"""Experiments across keys (docs/security.md, "Experiments"), against the live daphne of
tests/v1 with three keys: alice and bob hold inference keys, root an admin key. Alice's
sweep runs to completion on the engine; then every attack bob can make is sent over HTTP
and the test checks that nothing happened: her run, points and downloads are 404 for him,
his cancel of her run changes nothing, his list holds none of hers; without a key every
route is 401 and nothing is created; a 10 MB body, a grid over EXPERIMENT_MAX_POINTS, a
prompt over its size, a format the server does not write, run ids that try to escape,
and a calibration an inference key would save into a shared profile are refused before
anything runs."""

from __future__ import annotations

import json

import pytest

from experiments.models import ExperimentPoint, ExperimentRun
from tests.experiments.conftest import sae, wait_run  # noqa: F401 - sae: tiny-llama with its L1 SAE, every run ended after
from tests.security.across_keys import answer, call
from tests.v1.conftest import KEYS, _v1_db, keyed, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("keyed")]  # every call is a key's

SECRET = "violet harbor quartz lantern"


def sweep_body(sae, **extra) -> dict:
    return {
        "prompts": [SECRET],
        "variants": [{"sae_id": sae.id, "index": 3}],
        "strengths": [2.0],
        "max_tokens": 3,
        **extra,
    }


def test_one_keys_runs_are_a_404_for_another_and_never_listed(llama, sae):  # noqa: F811
    server = llama
    run = answer(call(server, "alice", "POST", "/api/experiments/sweep", sweep_body(sae)), 202)["run"]
    done = wait_run(run["id"])
    assert done.status == "completed" and done.owner == "key:alice"
    points = ExperimentPoint.objects.filter(run=done).count()
    assert points == 2
    for method, path in (
        ("GET", f"/api/experiments/{done.id}"),
        ("GET", f"/api/experiments/{done.id}/points"),
        ("GET", f"/api/experiments/{done.id}/download?format=jsonl"),
        ("GET", f"/api/experiments/{done.id}/download?format=parquet"),
        ("POST", f"/api/experiments/{done.id}/cancel"),
    ):
        got = answer(call(server, "bob", method, path), 404, "EXPERIMENT_NOT_FOUND")
        assert SECRET not in json.dumps(got)
    listed = answer(call(server, "bob", "GET", "/api/experiments"), 200)
    assert listed == {"runs": [], "total": 0}
    # nothing changed: the run, its points
    again = ExperimentRun.objects.get(id=done.id)
    assert (again.status, again.done, again.partial) == ("completed", done.done, False)
    assert ExperimentPoint.objects.filter(run=done).count() == points
    # alice sees her own; root (admin) sees every key's
    assert answer(call(server, "alice", "GET", "/api/experiments"), 200)["total"] == 1
    assert answer(call(server, "root", "GET", f"/api/experiments/{done.id}"), 200)["id"] == done.id
    status, raw = call(server, "root", "GET", f"/api/experiments/{done.id}/download?format=csv")
    assert status == 200 and SECRET not in raw.decode()  # the prompt is not in the points' rows
    # bob's own run is his, not hers
    mine = answer(call(server, "bob", "POST", "/api/experiments/sweep", sweep_body(sae)), 202)["run"]
    assert ExperimentRun.objects.get(id=mine["id"]).owner == "key:bob"
    assert answer(call(server, "alice", "GET", f"/api/experiments/{mine['id']}"), 404, "EXPERIMENT_NOT_FOUND")
    wait_run(mine["id"])


def test_no_key_is_401_on_every_route_and_creates_nothing(llama, sae):  # noqa: F811
    server = llama
    for method, path, body in (
        ("POST", "/api/experiments/sweep", sweep_body(sae)),
        ("POST", "/api/experiments/calibrate", {"prompts": ["a"], "variant": {"index": 3}, "target_kl": 0.1}),
        ("GET", "/api/experiments", None),
        ("GET", "/api/experiments/exp_0123456789abcdef", None),
        ("GET", "/api/experiments/exp_0123456789abcdef/points", None),
        ("GET", "/api/experiments/exp_0123456789abcdef/download?format=csv", None),
        ("POST", "/api/experiments/exp_0123456789abcdef/cancel", None),
    ):
        status, _ = call(server, None, method, path, body)
        assert status == 401, (method, path)
    assert not ExperimentRun.objects.exists()


def test_oversized_and_costly_inputs_create_nothing(llama, sae, settings):  # noqa: F811
    server = llama
    big = json.dumps(sweep_body(sae, prompts=["x" * (10 * 2**20)])).encode()
    resp = request(
        server.url, "POST", "/api/experiments/sweep", raw=big, headers={"Authorization": f"Bearer {KEYS['alice']}"}
    )
    assert resp.status == 413 and resp.json()["error"]["code"] == "PAYLOAD_TOO_LARGE", resp.body[:300]
    settings.EXPERIMENT_MAX_POINTS = 10
    grid = sweep_body(sae, prompts=["a", "b"], strengths=[1.0, 2.0, 3.0, 4.0, 5.0])  # 2 × (1 + 5) = 12
    error = answer(call(server, "alice", "POST", "/api/experiments/sweep", grid), 422, "VALIDATION_ERROR")
    assert error["details"]["param"] == "prompts" and "EXPERIMENT_MAX_POINTS" in error["message"]
    # a long prompt, a long chat, too many prompts, too many tokens
    for body in (
        sweep_body(sae, prompts=["y" * 20_001]),
        sweep_body(sae, prompts=[{"messages": [{"role": "user", "content": "z" * 20_001}]}]),
        sweep_body(sae, prompts=["a"] * 257),
        sweep_body(sae, max_tokens=100_000),
        sweep_body(sae, variants=[{"index": 3}] * 65),
    ):
        answer(call(server, "alice", "POST", "/api/experiments/sweep", body), 422, "VALIDATION_ERROR")
    assert not ExperimentRun.objects.exists()


def test_bad_formats_escaping_ids_and_a_profile_save_by_an_inference_key(llama, sae):  # noqa: F811
    from steering.models import Profile

    server = llama
    run = answer(call(server, "alice", "POST", "/api/experiments/sweep", sweep_body(sae)), 202)["run"]
    wait_run(run["id"])
    for fmt in ("xlsx", "../../etc/passwd", "json", "CSV"):
        status, body = call(server, "alice", "GET", f"/api/experiments/{run['id']}/download?format={fmt}")
        assert status == 422 and body["error"]["code"] == "VALIDATION_ERROR", (fmt, body)
    for path in (
        "/api/experiments/..%2F..%2Fetc%2Fpasswd",
        f"/api/experiments/{run['id']}%2F..%2Fcancel",
        "/api/experiments/exp_../points",
        "/api/experiments/dash_0123456789abcdef",
    ):
        status, _ = call(server, "alice", "GET", path)
        assert status == 404, path
    # saving into a profile is an admin's right: an inference key is refused, nothing made
    body = {
        "prompts": ["the cat"],
        "variant": {"sae_id": sae.id, "index": 3},
        "target_kl": 0.1,
        "save_profile": "alice-writes-here",
    }
    answer(call(server, "alice", "POST", "/api/experiments/calibrate", body), 403, "FORBIDDEN")
    assert not Profile.objects.filter(name="alice-writes-here").exists()
    assert ExperimentRun.objects.filter(kind="calibration").count() == 0
    # root may
    made = answer(call(server, "root", "POST", "/api/experiments/calibrate", {**body, "max_iterations": 2}), 202)
    wait_run(made["run"]["id"])
