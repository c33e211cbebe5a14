"""A run whose runner keeps dying ends (docs/features.md, "How a run works"): each
take-over from a runner that is gone counts as a resume, and once a run has been resumed
BATCH_MAX_RESUMES times the next take-over ends it ``failed`` with
DASHBOARD_RUNNER_FAILED, its working folder removed and nothing stored, instead of
running it again forever (a corpus that kills its worker every time)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from features import services
from features.models import DashboardRun, FeatureDashboard
from registry.models import SAE

pytestmark = pytest.mark.django_db


@pytest.fixture
def dead_run(settings, tmp_path):
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    sae = SAE.objects.create(name="resume-sae", format=SAE.Format.SAELENS, d_sae=32)
    run = DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=64, status="running", runner="dead-runner", runner_seen_at=timezone.now()
    )
    services.workdir(run.id).mkdir(parents=True)
    (services.workdir(run.id) / "checkpoint.json").write_text("{}")
    return run


def test_each_take_over_from_a_gone_runner_counts_and_the_cap_ends_the_run(settings, dead_run):
    settings.BATCH_MAX_RESUMES = 2
    for n in (1, 2):
        verdict, run = services.dashboard_take_over(run_id=dead_run.id, runner=f"runner-{n}", force=True)
        assert verdict == "run" and (run.status, run.resumes, run.runner) == ("running", n, f"runner-{n}")
        # the same runner taking it again (its own loop) is not a resume
        assert services.dashboard_take_over(run_id=dead_run.id, runner=f"runner-{n}")[0] == "run"
        assert DashboardRun.objects.get(id=dead_run.id).resumes == n
    verdict, run = services.dashboard_take_over(run_id=dead_run.id, runner="runner-3", force=True)
    assert (verdict, run) == ("done", None)
    ended = DashboardRun.objects.get(id=dead_run.id)
    assert (ended.status, ended.complete, ended.runner) == ("failed", False, None)
    assert ended.error["code"] == "DASHBOARD_RUNNER_FAILED" and "BATCH_MAX_RESUMES=2" in ended.error["message"]
    assert not services.workdir(dead_run.id).exists()
    assert FeatureDashboard.objects.count() == 0


def test_a_first_runner_is_not_a_resume(settings, dead_run):
    settings.BATCH_MAX_RESUMES = 0
    fresh = DashboardRun.objects.create(sae=dead_run.sae, layer=1, token_budget=64)
    verdict, run = services.dashboard_take_over(run_id=fresh.id, runner="first")
    assert verdict == "run" and run.resumes == 0
    # with no resume allowed, the dead runner's run ends at the first take-over
    assert services.dashboard_take_over(run_id=dead_run.id, runner="other", force=True)[0] == "done"
    assert DashboardRun.objects.get(id=dead_run.id).status == "failed"
