"""Reads of the feature dashboards: runs (the caller's own; an admin sees all), a feature's
dashboard from the SAE's newest complete run, and search.

Older complete runs of an SAE stay stored; every read here takes the newest complete one
(``latest_run``), so a run that is cancelled or fails never hides the dashboards a
complete one stored.
"""

from __future__ import annotations

import re
from typing import Any

from django.db.models import Q, QuerySet

from core.auth import Principal
from features.errors import DashboardNotFound
from features.models import DashboardRun, FeatureDashboard
from registry.models import FeatureExplanation

WORD = re.compile(r"\w+", re.UNICODE)
# what a match weighs in search_features' score
LABEL_WEIGHT, EXPLANATION_WEIGHT, TOKEN_WEIGHT = 3.0, 1.0, 1.0
LOGIT_TOP_WEIGHT, LOGIT_BOTTOM_WEIGHT, CONTEXT_MAX_WEIGHT, CONTEXT_WEIGHT = 3.0, 1.0, 2.0, 1.0


def dashboard_get(run_id: str, principal: Principal) -> DashboardRun:
    """The run, if the caller may see it (its owner, or an admin); else 404 as if it did
    not exist."""
    query = DashboardRun.objects.filter(id=run_id)
    if not principal.admin:
        query = query.filter(owner=principal.owner)
    run = query.first()
    if run is None:
        raise DashboardNotFound(f"No dashboard run with id {run_id!r}", details={"param": "run_id"})
    return run


def runs_for(sae_id: str, principal: Principal | None = None) -> QuerySet:
    """The SAE's runs, newest first: the caller's own (an admin key, or None for the
    server itself: everyone's)."""
    query = DashboardRun.objects.filter(sae_id=sae_id)
    if principal is not None and not principal.admin:
        query = query.filter(owner=principal.owner)
    return query.order_by("-created_at", "-id")


def visible_runs(principal: Principal | None) -> Q:
    """The runs whose figures a caller may read: a run over the sample corpus is
    everyone's; a run over a /v1 file keeps that file's text in its contexts, so it is its
    owner's (as the file is); an admin key, and the server itself (None), read all."""
    if principal is None or principal.admin:
        return Q()
    return Q(corpus=DashboardRun.Corpus.SAMPLE) | Q(owner=principal.owner)


def latest_run(sae_id: str, principal: Principal | None = None) -> DashboardRun | None:
    """The SAE's newest complete run the caller may read (the one every feature read takes)."""
    return (
        DashboardRun.objects.filter(visible_runs(principal), sae_id=sae_id, complete=True)
        .order_by("-finished_at", "-created_at", "-id")
        .first()
    )


def feature_dashboard(sae_id: str, index: int, principal: Principal | None = None) -> FeatureDashboard | None:
    """The feature's row of the newest complete run, or None (no complete run, or the
    feature never fired in it and has no logit effect)."""
    run = latest_run(sae_id, principal)
    if run is None:
        return None
    return FeatureDashboard.objects.filter(run=run, index=index).first()


def _norm(token: str) -> str:
    return token.strip().lower()


def _labels(sae_id: str) -> dict[int, str]:
    try:
        from registry.labels import labels_for
    except ImportError:  # the labels module not there: the best explanation by hand
        labels: dict[int, str] = {}
        for row in FeatureExplanation.objects.filter(sae_id=sae_id).order_by("index", "-score", "-created_at"):
            labels.setdefault(row.index, row.description)
        return labels
    return labels_for(sae_id)


def _token_places(row: dict[str, Any], token: str) -> tuple[float, list[str]]:
    """Where ``token`` appears in the row's logit effects and top contexts: the score of
    those places and their names."""
    score, matched = 0.0, []
    if any(_norm(str(e.get("token", ""))) == token for e in row.get("logit_top") or []):
        score += LOGIT_TOP_WEIGHT
        matched.append("logit_top")
    if any(_norm(str(e.get("token", ""))) == token for e in row.get("logit_bottom") or []):
        score += LOGIT_BOTTOM_WEIGHT
        matched.append("logit_bottom")
    at_max = in_context = 0
    for ctx in row.get("top_contexts") or []:
        tokens = [_norm(str(t)) for t in ctx.get("tokens") or []]
        where = ctx.get("max_position")
        if isinstance(where, int) and 0 <= where < len(tokens) and tokens[where] == token:
            at_max += 1
        elif token in tokens:
            in_context += 1
    if at_max:
        score += CONTEXT_MAX_WEIGHT * at_max
        matched.append("top_context_max")
    if in_context:
        score += CONTEXT_WEIGHT * in_context
        matched.append("top_context")
    return score, matched


def search_features(
    sae_id: str,
    q: str | None = None,
    token: str | None = None,
    limit: int = 20,
    offset: int = 0,
    principal: Principal | None = None,
) -> dict[str, Any]:
    """The SAE's features ranked by how well they match: ``q``'s words in the feature's
    label (weight 3), its explanations (1 each) and its top contexts' and logit effects'
    tokens (``search_tokens``, 1 each); ``token`` in its logit effects (top 3, bottom 1)
    or its top contexts (at the max 2, elsewhere 1). With both, a feature must match each.
    With neither, every feature with a dashboard or a label, by index. Ties by index.
    ``matched`` names what matched (``label:<word>``, ``explanation:<word>``,
    ``token:<word>``, ``logit_top``, ``top_context_max``...)."""
    words = sorted({w.lower() for w in WORD.findall(q or "")})
    wanted = _norm(token or "")
    run = latest_run(sae_id, principal)
    rows = FeatureDashboard.objects.filter(run=run) if run is not None else FeatureDashboard.objects.none()
    labels = _labels(sae_id)
    hits: dict[int, dict[str, Any]] = {}

    def hit(index: int) -> dict[str, Any]:
        return hits.setdefault(index, {"index": index, "score": 0.0, "matched": [], "words": set()})

    if words:
        for index, label in labels.items():
            found = [w for w in words if w in {x.lower() for x in WORD.findall(label)}]
            for w in found:
                h = hit(index)
                h["score"] += LABEL_WEIGHT
                h["matched"].append(f"label:{w}")
                h["words"].add(w)
        word_filter = Q()
        for w in words:
            word_filter |= Q(description__icontains=w)
        for index, text in FeatureExplanation.objects.filter(Q(sae_id=sae_id) & word_filter).values_list(
            "index", "description"
        ):
            present = {x.lower() for x in WORD.findall(text)}
            for w in words:
                if w in present:
                    h = hit(index)
                    h["score"] += EXPLANATION_WEIGHT
                    h["matched"].append(f"explanation:{w}")
                    h["words"].add(w)
        token_filter = Q()
        for w in words:
            token_filter |= Q(search_tokens__icontains=w)
        for index, text in rows.filter(token_filter).values_list("index", "search_tokens"):
            present = {x.lower() for x in WORD.findall(text or "")}
            for w in words:
                if w in present:
                    h = hit(index)
                    h["score"] += TOKEN_WEIGHT
                    h["matched"].append(f"token:{w}")
                    h["words"].add(w)
    by_token: dict[int, tuple[float, list[str]]] = {}
    if wanted:
        for row in rows.filter(search_tokens__icontains=wanted).values(
            "index", "logit_top", "logit_bottom", "top_contexts"
        ):
            score, places = _token_places(row, wanted)
            if score:
                by_token[row["index"]] = (score, places)
    if words and wanted:
        indices = [i for i in hits if i in by_token]
    elif words:
        indices = list(hits)
    elif wanted:
        indices = list(by_token)
    else:
        indices = sorted(set(rows.values_list("index", flat=True)) | set(labels))
    for index in indices:
        if index in by_token:
            h = hit(index)
            h["score"] += by_token[index][0]
            h["matched"].extend(by_token[index][1])
    ranked = sorted(indices, key=lambda i: (-hits[i]["score"] if i in hits else 0.0, i))
    page = ranked[offset : offset + limit]
    figures = {r["index"]: r for r in rows.filter(index__in=page).values("index", "density", "max")}
    return {
        "features": [
            {
                "index": i,
                "label": labels.get(i),
                "density": figures.get(i, {}).get("density"),
                "max": figures.get(i, {}).get("max"),
                "score": float(hits[i]["score"]) if i in hits else 0.0,
                "matched": list(hits[i]["matched"]) if i in hits else [],
            }
            for i in page
        ],
        "total": len(ranked),
    }
