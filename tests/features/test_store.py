"""Storing a run's rows (docs/features.md, "How a dashboard run works"): every feature's
row lands as the accumulator gave it, in PostgreSQL's jsonb as well, and a string holding
a NUL anywhere in a row (which jsonb and text columns refuse) is stored with the NUL shown
as U+2400 — the row as a whole, not half of it."""

from __future__ import annotations

import math

import pytest
from django.utils import timezone

from features import services
from features.models import DashboardRun, FeatureDashboard
from registry.models import SAE

pytestmark = pytest.mark.django_db


def window(tokens, acts):
    return {
        "context": 3,
        "tokens": tokens,
        "token_ids": list(range(len(tokens))),
        "activations": acts,
        "max_position": 0,
        "max_activation": acts[0],
        "start": 0,
    }


def row(index, token="plain", logit_token="end"):
    return {
        "index": index,
        "count": 2,
        "density": 0.25,
        "mean": 1.5,
        "max": 2.0,
        "histogram": {"edges": [0.0, 1.0, 2.0], "counts": [1, 1]},
        "top_contexts": [window([token, "b"], [2.0, 0.1])],
        "quantile_samples": [{"band": [0.0, 2.0], "contexts": [window(["c", token], [1.0, 0.5])]}],
        "logit_top": [{"token_id": 7, "token": logit_token, "value": 0.125}],
        "logit_bottom": [{"token_id": 8, "token": "low", "value": -0.5}],
        "search_tokens": "plain end",
    }


@pytest.fixture
def running(settings, tmp_path):
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    sae = SAE.objects.create(name="store-sae", format=SAE.Format.SAELENS, d_sae=32)
    return DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=64, status="running", runner="me", runner_seen_at=timezone.now()
    )


def test_rows_are_stored_as_given_and_nul_strings_are_shown(running):
    rows = [row(0), row(1, token="a\x00b"), row(2, logit_token="\x00")]
    status = services.dashboard_store(run_id=running.id, runner="me", rows=rows, summary={"tokens": 8, "note": "x\x00"})
    assert status == "completed"
    stored = {d.index: d for d in FeatureDashboard.objects.filter(run_id=running.id)}
    assert sorted(stored) == [0, 1, 2]
    plain = stored[0]
    assert plain.top_contexts == rows[0]["top_contexts"]
    assert plain.quantile_samples == rows[0]["quantile_samples"]
    assert plain.histogram == rows[0]["histogram"] and plain.logit_top == rows[0]["logit_top"]
    assert (plain.count, plain.density, plain.mean, plain.max) == (2, 0.25, 1.5, 2.0)
    assert stored[1].top_contexts[0]["tokens"] == ["a\u2400b", "b"]
    assert stored[1].quantile_samples[0]["contexts"][0]["tokens"] == ["c", "a\u2400b"]
    assert stored[1].logit_top == rows[0]["logit_top"]  # the rest of the row untouched
    assert stored[2].logit_top[0]["token"] == "\u2400" and stored[2].top_contexts == rows[0]["top_contexts"]
    assert DashboardRun.objects.get(id=running.id).summary == {"tokens": 8, "note": "x\u2400"}


def test_floats_keep_their_value_and_a_nan_is_stored_as_null(running):
    r = row(0)
    r["top_contexts"][0]["activations"] = [0.1 + 0.2, 1e-300, 123456.789, math.nan]
    r["histogram"]["edges"] = [0.0, 1 / 3, 2 / 3]
    services.dashboard_store(run_id=running.id, runner="me", rows=[r], summary={})
    d = FeatureDashboard.objects.get(run_id=running.id)
    assert d.top_contexts[0]["activations"] == [0.1 + 0.2, 1e-300, 123456.789, None]
    assert d.histogram["edges"] == [0.0, 1 / 3, 2 / 3]
