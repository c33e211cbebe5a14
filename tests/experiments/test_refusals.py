"""What a sweep or a calibration refuses before anything runs (docs/experiments.md, "Bad
input"), on the live server with tiny-llama and its L1 SAE (d_sae 256): each answer names
the field, and no run, point or engine job is made. Also the routes' wiring: cut
experiments.urls out of millm_site/urls.py and the first test fails."""

from __future__ import annotations

import msgspec
import pytest
from django.urls import resolve

from experiments import apis
from tests.experiments.conftest import api, ok, refused

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_routes_are_wired_under_api():
    expected = {
        "/api/experiments": apis.ExperimentListApi,
        "/api/experiments/sweep": apis.SweepStartApi,
        "/api/experiments/calibrate": apis.CalibrateStartApi,
        "/api/experiments/exp_0123456789abcdef": apis.ExperimentDetailApi,
        "/api/experiments/exp_0123456789abcdef/points": apis.ExperimentPointsApi,
        "/api/experiments/exp_0123456789abcdef/download": apis.ExperimentDownloadApi,
        "/api/experiments/exp_0123456789abcdef/cancel": apis.ExperimentCancelApi,
    }
    for url, view in expected.items():
        assert resolve(url).func.view_class is view, url


@pytest.fixture
def no_jobs(monkeypatch):
    """Every engine job the server sends, counted (a refusal sends none)."""
    from core.runtime import runtime

    engine = runtime().engine
    sent: list[str] = []
    real = engine.agenerate

    def agenerate(job):
        sent.append(job.request_id)
        return real(job)

    monkeypatch.setattr(engine, "agenerate", agenerate)
    return sent


def named(sae, variant):
    """``variant`` naming the test's SAE where it names no attachment itself: the shared
    server may hold other tests' attachments, and an unnamed variant would then be
    refused as ambiguous before the check the case is about."""
    if not isinstance(variant, dict) or "sae_id" in variant or "layer" in variant:
        return variant
    variant = {"sae_id": sae.id, **variant}
    target = variant.get("target")
    if isinstance(target, dict) and "sae_id" not in target and "layer" not in target:
        variant["target"] = {"sae_id": sae.id, **target}
    return variant


def sweep_body(sae, **extra):
    body = {
        "prompts": ["the cat sat"],
        "variants": [{"sae_id": sae.id, "index": 3}],
        "strengths": [1.0],
        "max_tokens": 4,
        **extra,
    }
    if isinstance(body["variants"], list):
        body["variants"] = [named(sae, v) for v in body["variants"]]
    return body


CASES = [
    # (what, body changes, status, code, param)
    (
        "a grid over the cap",
        {"strengths": [float(i) for i in range(40)], "prompts": ["a"] * 7},
        422,
        "VALIDATION_ERROR",
        "prompts",
    ),
    ("a feature past d_sae", {"variants": [{"index": 256}]}, 400, "INVALID_FEATURE_INDEX", "variants[0].index"),
    (
        "an SAE not attached",
        {"variants": [{"sae_id": "sae_nope", "index": 3}]},
        400,
        "SAE_NOT_ATTACHED",
        "variants[0].sae_id",
    ),
    (
        "a layer with no attachment",
        {"variants": [{"layer": 7, "index": 3}]},
        400,
        "SAE_NOT_ATTACHED",
        "variants[0].sae_id",
    ),
    ("a strength past 200", {"strengths": [250.0]}, 422, "VALIDATION_ERROR", "strengths"),
    (
        "ablate, which takes no strength",
        {"variants": [{"index": 3, "mode": "ablate"}]},
        422,
        "VALIDATION_ERROR",
        "variants[0].mode",
    ),
    ("an unknown mode", {"variants": [{"index": 3, "mode": "twist"}]}, 422, "VALIDATION_ERROR", "variants[0].mode"),
    (
        "an unknown variant field",
        {"variants": [{"index": 3, "colour": "red"}]},
        422,
        "VALIDATION_ERROR",
        "variants[0].colour",
    ),
    (
        "a target past d_sae",
        {"variants": [{"index": 3, "target": {"index": 999}}]},
        400,
        "INVALID_FEATURE_INDEX",
        "variants[0].target.index",
    ),
    ("a prompt that is a number", {"prompts": [5]}, 422, "VALIDATION_ERROR", "prompts[0]"),
    ("a chat without messages", {"prompts": [{"msgs": []}]}, 422, "VALIDATION_ERROR", "prompts[0]"),
    (
        "a message of an unknown role",
        {"prompts": [{"messages": [{"role": "wizard", "content": "x"}]}]},
        422,
        "VALIDATION_ERROR",
        None,
    ),
    ("an empty prompt", {"prompts": [""]}, 422, "VALIDATION_ERROR", "prompts[0]"),
    ("a prompt over 20,000 characters", {"prompts": ["x" * 20_001]}, 422, "VALIDATION_ERROR", "prompts[0]"),
    ("max_tokens over 512", {"max_tokens": 513}, 422, "VALIDATION_ERROR", "max_tokens"),
    (
        "a vector gated to a phase",
        {"variants": [{"vector": {"data": [0.1] * 64, "phase": "prompt"}}]},
        422,
        "VALIDATION_ERROR",
        "variants[0].vector.phase",
    ),
    (
        "a vector of the wrong width",
        {"variants": [{"vector": {"data": [0.1] * 3}}]},
        422,
        "VALIDATION_ERROR",
        "variants[0].vector.data",
    ),
    ("no strengths", {"strengths": []}, 422, "VALIDATION_ERROR", "strengths"),
    ("a strength that is text", {"strengths": ["1"]}, 422, "VALIDATION_ERROR", "strengths[0]"),
]


@pytest.mark.parametrize(("what", "change", "status", "code", "param"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_sweep_is_refused_naming_the_field_before_anything_runs(
    sae, llama, no_jobs, what, change, status, code, param
):
    from experiments.models import ExperimentPoint, ExperimentRun

    body = sweep_body(sae, **change)
    got, answer = api(llama, "POST", "/api/experiments/sweep", body)
    assert got == status, (what, answer)
    assert answer["success"] is False, answer
    if code is not None:
        assert answer["error"]["code"] == code, answer
    if param is not None:
        error = answer["error"]
        assert error["details"].get("param") == param or param in (error["details"].get("fields") or {}), answer
    assert not ExperimentRun.objects.exists() and not ExperimentPoint.objects.exists()
    assert no_jobs == []


def test_a_mode_the_backend_cannot_run_is_refused_by_name(sae, llama, no_jobs, monkeypatch):
    """A backend whose capabilities say it cannot run feature controls (llama.cpp's swap
    mode): a clamp is refused naming the variant's mode; a plain add still runs."""
    from core.runtime import runtime
    from experiments.models import ExperimentRun

    engine = runtime().engine
    real = engine.status

    def status():
        got = real()
        caps = msgspec.structs.replace(
            got.capabilities, steering_controls=False, steering_controls_reason="control vectors are swapped whole"
        )
        return msgspec.structs.replace(
            got, batching={**(got.batching or {}), "capabilities": msgspec.to_builtins(caps)}
        )

    monkeypatch.setattr(engine, "status", status)
    error = refused(
        api(llama, "POST", "/api/experiments/sweep", sweep_body(sae, variants=[{"index": 3, "mode": "clamp"}])),
        422,
        "VALIDATION_ERROR",
        "variants[0].mode",
    )
    assert "steering_controls" in error["message"]
    assert not ExperimentRun.objects.exists() and no_jobs == []
    # positive control: the same body with an add is accepted
    ok(api(llama, "POST", "/api/experiments/sweep", sweep_body(sae)), 202)


def test_a_bad_calibration_is_refused_before_anything_runs(sae, llama, no_jobs):
    from experiments.models import ExperimentRun

    base = {"prompts": ["the cat"], "variant": {"sae_id": sae.id, "index": 3}, "target_kl": 0.1}
    for change, status, code, param in (
        ({"bounds": [5.0, 1.0]}, 422, "VALIDATION_ERROR", "bounds"),
        ({"bounds": [0.0, 300.0]}, 422, "VALIDATION_ERROR", "bounds"),
        ({"variant": {"index": 999}}, 400, "INVALID_FEATURE_INDEX", "variant.index"),
        ({"target_kl": -1}, 422, "VALIDATION_ERROR", None),
        ({"max_iterations": 500}, 422, "VALIDATION_ERROR", None),
        ({"prompts": ["a"] * 30, "max_iterations": 20}, 422, "VALIDATION_ERROR", "prompts"),
    ):
        body = {**base, **change}
        body["variant"] = named(sae, body["variant"])
        refused(api(llama, "POST", "/api/experiments/calibrate", body), status, code, param)
    assert not ExperimentRun.objects.exists() and no_jobs == []


def test_unknown_runs_and_bad_queries(sae, llama):
    refused(api(llama, "GET", "/api/experiments/exp_0000000000000000"), 404, "EXPERIMENT_NOT_FOUND")
    refused(api(llama, "POST", "/api/experiments/exp_0000000000000000/cancel"), 404, "EXPERIMENT_NOT_FOUND")
    refused(api(llama, "GET", "/api/experiments/exp_0000000000000000/download?format=csv"), 404, "EXPERIMENT_NOT_FOUND")
    refused(api(llama, "GET", "/api/experiments?kind=cooking"), 422, "VALIDATION_ERROR")
    refused(api(llama, "GET", "/api/experiments?limit=100000"), 422, "VALIDATION_ERROR")
    assert ok(api(llama, "GET", "/api/experiments")) == {"runs": [], "total": 0}
