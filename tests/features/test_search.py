"""Search and the feature read over stored runs (features.selectors; docs/features.md,
"Search"): which run is read, how matches rank, what ``matched`` says. The rows are
written by the test; the weights are the documented ones (label 3, explanation 1, a
context or logit token 1; ``token``: logit top 3, bottom 1, at a top context's max 2,
elsewhere in one 1)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from features.models import DashboardRun, FeatureDashboard
from features.selectors import feature_dashboard, search_features
from registry.models import SAE, FeatureExplanation

pytestmark = pytest.mark.django_db


@pytest.fixture
def sae():
    return SAE.objects.create(name="search-sae", format=SAE.Format.SAELENS, d_sae=32)


def run(sae, *, complete: bool = True, age_s: float = 0.0, status: str = "completed") -> DashboardRun:
    at = timezone.now() - timedelta(seconds=age_s)
    return DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=64, status=status, complete=complete, finished_at=at
    )


def row(run_: DashboardRun, index: int, *, top=(), bottom=(), contexts=(), density: float = 0.1) -> FeatureDashboard:
    """A feature's row: logit tokens and top contexts given as token lists (max at the
    position named, else 0)."""
    top_contexts = [
        {"context": n, "tokens": list(toks), "max_position": at, "activations": [1.0] * len(toks), "start": 0}
        for n, (toks, at) in enumerate(contexts)
    ]
    words = [*top, *bottom, *(t for toks, _ in contexts for t in toks)]
    return FeatureDashboard.objects.create(
        run=run_,
        sae=run_.sae,
        index=index,
        count=1,
        density=density,
        max=2.0,
        logit_top=[{"token_id": i, "token": t, "value": 1.0} for i, t in enumerate(top)],
        logit_bottom=[{"token_id": i, "token": t, "value": -1.0} for i, t in enumerate(bottom)],
        top_contexts=top_contexts,
        search_tokens=" ".join(w.strip().lower() for w in words),
    )


def explain(sae, index: int, text: str, score: float | None = None) -> None:
    FeatureExplanation.objects.create(sae=sae, index=index, description=text, source="user", score=score)


def test_the_newest_complete_run_is_read_and_an_unfinished_one_never(sae):
    old = run(sae, age_s=100)
    row(old, 1, top=[" old"])
    new = run(sae, age_s=10)
    row(new, 1, top=[" new"])
    running = run(sae, complete=False, status="running")
    row(running, 1, top=[" running"])  # cannot happen in the product; a read must still skip it
    assert feature_dashboard(sae.id, 1).run_id == new.id
    assert feature_dashboard(sae.id, 2) is None
    assert [h["index"] for h in search_features(sae.id, None, "new")["features"]] == [1]
    assert search_features(sae.id, None, "old") == {"features": [], "total": 0}
    assert search_features(sae.id, None, "running") == {"features": [], "total": 0}


def test_q_ranks_label_over_explanation_over_tokens(sae):
    r = run(sae)
    row(r, 3, contexts=[([" the", " river", " bank"], 1)])  # the word in a context only
    row(r, 5)
    row(r, 7)
    explain(sae, 5, "money held at a bank", score=0.9)  # its label
    explain(sae, 7, "rivers and lakes", score=0.9)  # label without the word
    explain(sae, 7, "the bank of a river", score=0.1)  # an explanation with it
    found = search_features(sae.id, "Bank", None)
    assert [(h["index"], h["score"]) for h in found["features"]] == [(5, 4.0), (3, 1.0), (7, 1.0)]
    assert found["total"] == 3
    assert found["features"][0]["matched"] == ["label:bank", "explanation:bank"]
    assert found["features"][0]["label"] == "money held at a bank"
    assert found["features"][1]["matched"] == ["token:bank"] and found["features"][1]["density"] == 0.1
    # two words: each adds (a word matches a whole word: "rivers" is not "river")
    two = search_features(sae.id, "river bank", None)
    assert [(h["index"], h["score"]) for h in two["features"]] == [(5, 4.0), (3, 2.0), (7, 2.0)]
    # paging keeps the order and the total
    page = search_features(sae.id, "bank", None, limit=1, offset=1)
    assert [h["index"] for h in page["features"]] == [3] and page["total"] == 3


def test_token_ranks_logit_top_over_a_contexts_max_over_elsewhere(sae):
    r = run(sae)
    row(r, 1, top=[" Paris", " London"])  # 3
    row(r, 2, contexts=[([" in", " Paris", " today"], 1), ([" Paris", " is"], 1)])  # max once 2, elsewhere once 1
    row(r, 4, bottom=["paris"])  # 1
    row(r, 6, top=[" Parisian"])  # another token: no match
    found = search_features(sae.id, None, " PARIS ")
    assert [(h["index"], h["score"]) for h in found["features"]] == [(1, 3.0), (2, 3.0), (4, 1.0)]
    assert found["features"][1]["matched"] == ["top_context_max", "top_context"]
    # q and token: a feature must match both
    explain(sae, 4, "the French capital")
    explain(sae, 6, "capital cities")
    both = search_features(sae.id, "capital", "paris")
    assert [(h["index"], h["score"]) for h in both["features"]] == [(4, 5.0)]  # 3 + 1 for q, 1 for token


def test_neither_lists_every_feature_with_a_dashboard_or_a_label(sae):
    r = run(sae)
    row(r, 8)
    explain(sae, 2, "a label without a dashboard")
    found = search_features(sae.id, "", "")
    assert [(h["index"], h["label"], h["density"]) for h in found["features"]] == [
        (2, "a label without a dashboard", None),
        (8, None, 0.1),
    ]
