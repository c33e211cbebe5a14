"""``manage.py fidelity`` and ``manage.py attribution``: the services behind POST
/api/experiments/fidelity, GET /api/saes/{id}/fidelity and POST /api/experiments/attribution
with the same checks. Each command's answer is compared with the route's answer for the
same input, computed here through the API on the same engine; every refusal is one line
``CODE: message`` with exit status 2 and nothing created (no run, no engine work)."""

from __future__ import annotations

import json
import math
import time
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from experiments.management.commands.attribution import Command as AttributionCommand
from experiments.models import ExperimentRun
from orchestration import tasks
from tests.api.conftest import engine_client, llama_saes, ok, run_job, tiny_llama  # noqa: F401 - fixtures
from tests.distributed.conftest import redis_port, redis_url  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)  # a --wait run's thread reads what the command committed

SAE = "tiny-llama-L1-relu"
PROMPT = "the quick brown fox jumps over the lazy dog and the"
TERMINAL = ("completed", "failed", "cancelled")
# two runs of the same corpus batch their passes differently at the engine: float32 sums
# of the same rows in another order
FIGURE_RTOL = 1e-5


def _run(name: str, *args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(name, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def _json(name: str, *args: str) -> Any:
    out, _ = _run(name, *args, "--json")
    return json.loads(out)  # --json prints the answer alone


def _refused(name: str, *args: str) -> str:
    with pytest.raises(CommandError) as info:
        _run(name, *args)
    assert info.value.returncode == 2, info.value
    assert "\n" not in str(info.value)
    return str(info.value)


def _same(got: Any, want: Any, path: str = "") -> None:
    """Equal, floats to FIGURE_RTOL."""
    if isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=FIGURE_RTOL, abs_tol=1e-12), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, got, want)
        for k in want:
            _same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def distributed(settings, redis_url):  # noqa: F811 - fixture
    """As in distributed mode, where a command reaches the engine: admission shared through
    a real Redis (attribution takes a slot there as a /v1 request does)."""
    from core.runtime import runtime
    from inference.admission_shared import SharedAdmissionController

    settings.EMBEDDED = False
    settings.REDIS_URL = redis_url
    with runtime().replaced(admission=SharedAdmissionController.from_settings()):
        yield
    settings.EMBEDDED = True


@pytest.fixture
def attached(settings, distributed, api, engine_client, tiny_llama, llama_saes):  # noqa: F811 - fixtures
    """tiny-llama resident with the L1 SAE attached at layer 1 (distributed mode); every
    run ended after."""
    settings.DASHBOARD_MAX_TOKENS = 4096
    data = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    sae = llama_saes[SAE]
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    yield sae
    ExperimentRun.objects.exclude(status__in=TERMINAL).update(status="cancelling")
    _until(lambda: not ExperimentRun.objects.exclude(status__in=TERMINAL).exists(), "every run to end")


def _until(check, what: str, timeout_s: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


# --------------------------------------------------------------------------- attribution


def test_attribution_prints_the_routes_answer(attached, api):
    sae = attached
    cases = [
        ({"prompt": PROMPT}, [PROMPT]),
        (
            {"prompt": PROMPT, "target_token": " the", "top_n": 4, "ablate_top": 2},
            [PROMPT, "--target", " the", "--top-n", "4", "--ablate-top", "2"],
        ),
        ({"prompt": PROMPT, "target_token": 7, "layer": 1}, [PROMPT, "--target-id", "7", "--layer", "1"]),
        (
            {"messages": [{"role": "user", "content": "hello there"}], "add_generation_prompt": False},
            ["--messages", '[{"role": "user", "content": "hello there"}]', "--no-generation-prompt"],
        ),
    ]
    for body, args in cases:
        want = ok(api.post("/api/experiments/attribution", {"sae_id": sae.id, **body}, format="json"))
        got = _json("attribution", sae.id, *args)
        assert got == want, body
    # the readable answer: the target, each top feature with its ablation check, one heat
    # row per prompt position
    answer = _json("attribution", sae.id, PROMPT, "--top-n", "3", "--ablate-top", "1")
    out, _ = _run("attribution", sae.id, PROMPT, "--top-n", "3", "--ablate-top", "1")
    lines = out.splitlines()
    target = answer["target"]
    assert lines[1].startswith(f"Target {target['text']!r} (id {target['id']}, logit {target['logit']:.6g}")
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("feature"))
    rows = lines[header + 1 : header + 1 + len(answer["features"])]
    assert len(answer["features"]) == 3
    for row, feature in zip(rows, answer["features"], strict=True):
        cells = row.split()
        assert int(cells[0]) == feature["index"]
        assert float(cells[1]) == pytest.approx(feature["attribution"], rel=1e-5)
        if feature["ablation_delta"] is None:
            assert cells[2] == "—"
        else:
            assert float(cells[2]) == pytest.approx(feature["ablation_delta"], rel=1e-5)
    assert [f["ablation_delta"] is None for f in answer["features"]] == [False, True, True]
    heat = lines[lines.index(next(x for x in lines if x.startswith("Heat"))) + 1 :]
    assert len(heat) == len(answer["tokens"])
    for row, h in zip(heat, answer["heat"], strict=True):
        assert int(row.split()[0]) == h["position"]
        for t in h["top"]:
            assert f"{t['index']} {t['attribution']:+.3g}" in row


def test_attribution_refusals_are_one_line_and_run_nothing(attached, engine_client, settings, tmp_path):  # noqa: F811
    sae = attached
    assert _refused("attribution", "sae_nope", PROMPT).startswith("SAE_NOT_FOUND")
    assert _refused("attribution", sae.id, PROMPT, "--layer", "2").startswith("SAE_NOT_ATTACHED")
    assert _refused("attribution", sae.id, PROMPT, "--layer", "-1").startswith("VALIDATION_ERROR: layer")
    assert _refused("attribution", sae.id).startswith("VALIDATION_ERROR: prompt")
    both = _refused("attribution", sae.id, PROMPT, "--messages", '[{"role": "user", "content": "x"}]')
    assert both.startswith("VALIDATION_ERROR: prompt")
    assert _refused("attribution", sae.id, "--messages", "[not json").startswith("VALIDATION_ERROR: messages")
    missing = str(tmp_path / "missing.json")
    assert _refused("attribution", sae.id, "--messages", missing).startswith("VALIDATION_ERROR: messages")
    assert _refused("attribution", sae.id, "--messages", '[{"role": "x", "content": "y"}]').startswith(
        "VALIDATION_ERROR: messages"
    )
    assert _refused("attribution", sae.id, PROMPT, "--no-generation-prompt").startswith(
        "VALIDATION_ERROR: add_generation_prompt"
    )
    not_one = _refused("attribution", sae.id, PROMPT, "--target", "the quick brown")
    assert not_one.startswith("VALIDATION_ERROR: 'the quick brown' is") and "not one" in not_one
    assert "outside the vocabulary" in _refused("attribution", sae.id, PROMPT, "--target-id", "100000000")
    assert _refused("attribution", sae.id, PROMPT, "--top-n", "0").startswith("VALIDATION_ERROR: top_n")
    assert _refused("attribution", sae.id, PROMPT, "--top-n", "2", "--ablate-top", "3").startswith(
        "VALIDATION_ERROR: ablate_top"
    )
    settings.EMBEDDED = True
    unavailable = _refused("attribution", sae.id, PROMPT)
    assert unavailable.startswith("ENGINE_UNAVAILABLE") and "POST /api/experiments/attribution" in unavailable
    assert engine_client.status().in_flight == 0


def test_attribution_on_a_backend_without_gradients_names_it(distributed, engine_client, tiny_assets, llama_saes):  # noqa: F811
    """A Q8 load's int8 kernels run forward only: the refusal names the backend and why."""
    from registry import services

    services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="llama-q8", quantization="Q8"
    )
    call_command("load_model", "llama-q8", stdout=StringIO())
    assert engine_client.status().capabilities.gradients is False
    error = _refused("attribution", llama_saes[SAE].id, PROMPT)
    assert error.startswith("ATTRIBUTION_UNSUPPORTED: The transformers backend cannot run attribution")
    assert "Q8" in error
    want = APIClient().post(
        "/api/experiments/attribution", {"sae_id": llama_saes[SAE].id, "prompt": PROMPT}, format="json"
    )
    assert want.status_code == 400 and error == f"ATTRIBUTION_UNSUPPORTED: {want.json()['error']['message']}"


def test_a_refusal_is_one_line_and_exit_status_2(llama_saes, capsys):  # noqa: F811 - fixture
    with pytest.raises(SystemExit) as info:
        AttributionCommand().run_from_argv(["manage.py", "attribution", "sae_nope", PROMPT])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["CommandError: SAE_NOT_FOUND: SAE 'sae_nope' not found"]


# --------------------------------------------------------------------------- fidelity


def _api_run(api, body: dict) -> dict:
    """The same run started through the route (the in-process experiments pool runs it)."""
    run = ok(api.post("/api/experiments/fidelity", body, format="json"), 202)["run"]
    _until(
        lambda: (r := ExperimentRun.objects.get(id=run["id"])).status in TERMINAL and r.runner is None,
        f"run {run['id']} to end",
    )
    return ok(api.get(f"/api/experiments/{run['id']}"))


def test_fidelity_waits_prints_and_shows_the_routes_figures(attached, api):
    sae = attached
    args = [sae.id, "--sample", "--budget", "256", "--context-tokens", "32", "--dense-threshold", "0.2"]
    out, err = _run("fidelity", *args, "--wait", "--json")
    run = json.loads(out)
    assert run["status"] == "completed" and run["kind"] == "fidelity" and run["layer"] == 1
    assert f"{run['id']} completed: 1/1" in err  # its progress
    assert run == ok(api.get(f"/api/experiments/{run['id']}"))
    # the route's run over the same input measures the same figures
    body = {"sae_id": sae.id, "token_budget": 256, "context_tokens": 32, "dense_threshold": 0.2}
    via_api = _api_run(api, body)
    assert via_api["status"] == "completed"
    assert run["spec"] == via_api["spec"]
    _same(run["result"], via_api["result"])
    assert run["result"]["tokens"] == 256 and run["result"]["dense_threshold"] == 0.2
    assert run["result"]["loss_recovered"] is not None

    # --show: a run (GET /api/experiments/{id}) and the SAE's newest (GET /api/saes/{id}/fidelity)
    assert _json("fidelity", "--show", run["id"]) == run
    newest = _json("fidelity", sae.id, "--show")
    assert newest == ok(api.get(f"/api/saes/{sae.id}/fidelity"))
    assert newest["run_id"] == via_api["id"]
    assert _json("fidelity", "--show", sae.id, "--layer", "1") == ok(api.get(f"/api/saes/{sae.id}/fidelity?layer=1"))
    assert _json("fidelity", sae.id, "--show", "--layer", "2") == ok(api.get(f"/api/saes/{sae.id}/fidelity?layer=2"))

    # the readable lines carry the same figures
    shown, _ = _run("fidelity", sae.id, "--show")
    figures = via_api["result"]
    assert shown.startswith(f"Fidelity of {sae.id} at layer 1 ({via_api['id']}, sample corpus, budget 256")
    for name, key in (("L0", "l0"), ("MSE", "mse"), ("explained variance", "explained_variance")):
        line = next(x for x in shown.splitlines() if x.strip().startswith(name + " "))
        assert float(line.split()[-1]) == pytest.approx(figures[key], rel=1e-5), name
    recovered = next(x for x in shown.splitlines() if "loss recovered" in x)
    assert float(recovered.split()[2]) == pytest.approx(figures["loss_recovered"], rel=1e-5)
    assert f"dead features       {figures['dead_count']} of {figures['d_sae']}" in shown
    out, _ = _run("fidelity", sae.id, "--budget", "64", "--context-tokens", "32", "--wait")
    assert "loss recovered" in out and "Completed exp_" in out and "64 tokens" in out
    assert "No complete fidelity run" in _run("fidelity", sae.id, "--show", "--layer", "2")[0]


def test_fidelity_queues_a_run_as_the_route_does(attached, api):
    sae = attached
    queued = _json("fidelity", sae.id, "--budget", "96", "--context-tokens", "16", "--layer", "1")
    run = queued["run"]
    assert (run["kind"], run["sae_id"], run["layer"], run["total"]) == ("fidelity", sae.id, 1, 1)
    assert run["spec"]["corpus"] == "sample" and run["spec"]["token_budget"] == 96
    out, _ = _run("fidelity", sae.id, "--budget", "96", "--context-tokens", "16")
    assert out.startswith("Queued exp_") and "manage.py fidelity --show exp_" in out
    assert ExperimentRun.objects.filter(kind="fidelity").count() == 2


def test_fidelity_refusals_are_one_line_and_create_nothing(attached, settings, tmp_path):
    sae = attached
    settings.DASHBOARD_MAX_TOKENS = 1000
    assert _refused("fidelity", "sae_nope", "--budget", "64").startswith("SAE_NOT_FOUND")
    assert _refused("fidelity", "nope", "--budget", "64").startswith("VALIDATION_ERROR: sae_id")
    assert _refused("fidelity", "--budget", "64").startswith("VALIDATION_ERROR: sae_id")
    assert _refused("fidelity", sae.id, "--sample").startswith("VALIDATION_ERROR: token_budget")
    assert _refused("fidelity", sae.id, "--budget", "0").startswith("VALIDATION_ERROR: token_budget")
    over = _refused("fidelity", sae.id, "--budget", "1001")
    assert over.startswith("VALIDATION_ERROR: token_budget") and "DASHBOARD_MAX_TOKENS" in over
    assert _refused("fidelity", sae.id, "--budget", "64", "--layer", "-1").startswith("VALIDATION_ERROR: layer")
    not_there = _refused("fidelity", sae.id, "--budget", "64", "--layer", "2")
    assert not_there.startswith("SAE_NOT_ATTACHED") and "1" in not_there
    assert _refused("fidelity", sae.id, "--budget", "64", "--context-tokens", "4").startswith(
        "VALIDATION_ERROR: context_tokens"
    )
    assert _refused("fidelity", sae.id, "--budget", "64", "--dense-threshold", "2").startswith(
        "VALIDATION_ERROR: dense_threshold"
    )
    assert _refused("fidelity", sae.id, "--budget", "64", "--file-id", "file-nope").startswith("FILE_NOT_FOUND")
    assert _refused("fidelity", sae.id, "--budget", "64", "--file-id", "f", "--text-field", "../x").startswith(
        "VALIDATION_ERROR: text_field"
    )
    assert _refused("fidelity", "--show", "exp_0000000000000000").startswith("EXPERIMENT_NOT_FOUND")
    assert _refused("fidelity", "--show").startswith("VALIDATION_ERROR: sae_id")
    assert _refused("fidelity", "sae_nope", "--show").startswith("SAE_NOT_FOUND")
    settings.EMBEDDED = True
    unavailable = _refused("fidelity", sae.id, "--budget", "64")
    assert unavailable.startswith("ENGINE_UNAVAILABLE") and "POST /api/experiments/fidelity" in unavailable
    assert not ExperimentRun.objects.exists()
    # --show reads what is stored: no engine needed
    assert _run("fidelity", sae.id, "--show")[0].startswith(f"No complete fidelity run for {sae.id}")
