"""Calibration end to end (docs/experiments.md, "Calibration"): the strength it finds gives,
by the test's own float64 forward teacher-forced on the run's default continuations, a
mean KL within tolerance of the target; every strength it measured is on its curve with
the KL the test computes for it; saving into a profile writes the strength there through
steering's profile services (an admin's right); a backend without teacher-forced
distributions is refused before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

from tests.experiments.conftest import KL_ATOL, KL_RTOL, api, ok, refused, wait_run

pytestmark = pytest.mark.django_db(transaction=True)

FEATURE = 3
PROMPTS = ["the cat sat on the mat and then it", "one two three four five"]


def own_mean_kl(own, defaults, strength: float) -> float:
    return float(np.mean([own.kl(ids, cont, {FEATURE: strength}).mean() for ids, cont in defaults]))


def defaults_of(run_id: str) -> list[tuple[list[int], list[int]]]:
    from experiments.models import ExperimentPoint

    rows = ExperimentPoint.objects.filter(run_id=run_id, is_default=True).order_by("prompt_index")
    return [(r.data["prompt_token_ids"], r.token_ids) for r in rows]


def test_calibration_finds_a_strength_within_tolerance_and_saves_it(sae, llama, own):
    from steering.models import Profile

    # the target: the test's own KL half-way along a strength it knows moves the model
    probe = ok(
        api(
            llama,
            "POST",
            "/api/experiments/sweep",
            {
                "prompts": PROMPTS,
                "variants": [{"sae_id": sae.id, "index": FEATURE}],
                "strengths": [0.0],
                "max_tokens": 6,
            },
        ),
        202,
    )["run"]
    assert wait_run(probe["id"]).status == "completed"
    defaults = defaults_of(probe["id"])
    target = own_mean_kl(own, defaults, 6.0) / 2
    assert target > 1e-3  # positive control: the budget is not met at strength 0
    tolerance = target / 20
    run = ok(
        api(
            llama,
            "POST",
            "/api/experiments/calibrate",
            {
                "prompts": PROMPTS,
                "variant": {"sae_id": sae.id, "index": FEATURE},
                "target_kl": target,
                "bounds": [0.0, 12.0],
                "tolerance": tolerance,
                "max_iterations": 20,
                "max_tokens": 6,
                "save_profile": "calibrated-f3",
            },
        ),
        202,
    )["run"]
    assert run["kind"] == "calibration" and run["sae_id"] == sae.id and run["layer"] == 1
    done = wait_run(run["id"])
    assert done.status == "completed", done.error
    result = done.result
    assert result["converged"] is True and result["reason"] is None
    assert defaults_of(run["id"]) == defaults  # the same default continuations (greedy)
    strength = result["strength"]
    assert 0.0 < strength < 12.0
    # the test's own KL at the strength found meets the budget
    assert abs(own_mean_kl(own, defaults, strength) - target) <= tolerance * 1.01 + KL_ATOL
    # every measured strength is on the curve with the test's own KL, in order
    curve = result["curve"]
    assert [c["strength"] for c in curve] == sorted(c["strength"] for c in curve)
    assert {0.0, 12.0, strength} <= {c["strength"] for c in curve}
    assert len(curve) == result["iterations"] + 2
    for c in curve:
        assert c["kl"] == pytest.approx(own_mean_kl(own, defaults, c["strength"]), rel=KL_RTOL, abs=KL_ATOL)
    assert result["kl"] == next(c["kl"] for c in curve if c["strength"] == strength)
    # saved into the profile through steering's services
    profile = Profile.objects.get(name="calibrated-f3")
    assert result["profile"] == {"id": profile.id, "name": "calibrated-f3"}
    assert (profile.sae_id, profile.layer) == (sae.id, 1)
    assert profile.steering == {str(FEATURE): strength}
    # the audit log: the start of each run, and the save as one entry of its own (the
    # worker's, so the actor is system), not a second profile.create
    from audit.models import AuditEntry

    started = AuditEntry.objects.get(action="experiment.calibrate")
    assert (started.target_kind, started.target_id, started.target_name, started.result) == (
        "experiment_run",
        run["id"],
        "calibration",
        "ok",
    )
    assert started.params["save_profile"] == "calibrated-f3" and "prompts" not in started.params
    assert AuditEntry.objects.get(action="experiment.sweep").target_id == probe["id"]
    saved = AuditEntry.objects.get(action="experiment.calibration_save")
    assert (saved.actor, saved.target_kind, saved.target_id, saved.target_name, saved.result) == (
        "system",
        "profile",
        str(profile.id),
        "calibrated-f3",
        "ok",
    )
    assert saved.params["run_id"] == run["id"] and saved.params["strength"] == strength
    assert not AuditEntry.objects.filter(action="profile.create").exists()


def test_calibration_outside_the_bounds_says_so_and_saves_nothing(sae, llama):
    from steering.models import Profile

    run = ok(
        api(
            llama,
            "POST",
            "/api/experiments/calibrate",
            {
                "prompts": PROMPTS[:1],
                "variant": {"sae_id": sae.id, "index": FEATURE},
                "target_kl": 50.0,
                "bounds": [0.0, 1.0],
                "max_tokens": 4,
                "save_profile": "never-saved",
            },
        ),
        202,
    )["run"]
    done = wait_run(run["id"])
    assert done.status == "completed", done.error
    assert done.result["converged"] is False and "widen the bounds" in done.result["reason"]
    assert done.result["iterations"] == 0 and len(done.result["curve"]) == 2
    assert done.result["strength"] == 1.0  # the closest measured
    assert not Profile.objects.filter(name="never-saved").exists()


def test_calibration_is_refused_where_the_backend_lacks_distributions(sae, llama, monkeypatch):
    from core.runtime import runtime
    from experiments.models import ExperimentRun

    engine = runtime().engine
    real = engine.status

    def status():
        import msgspec

        got = real()
        caps = msgspec.structs.replace(
            got.capabilities, prompt_distributions=False, prompt_distributions_reason="not exactly in this backend"
        )
        return msgspec.structs.replace(
            got, batching={**(got.batching or {}), "capabilities": msgspec.to_builtins(caps)}
        )

    monkeypatch.setattr(engine, "status", status)
    error = refused(
        api(
            llama,
            "POST",
            "/api/experiments/calibrate",
            {"prompts": PROMPTS, "variant": {"sae_id": sae.id, "index": FEATURE}, "target_kl": 0.1},
        ),
        422,
        "EXPERIMENT_UNAVAILABLE",
        "target_kl",
    )
    assert error["details"]["reason"] == "not exactly in this backend"
    assert not ExperimentRun.objects.exists()
