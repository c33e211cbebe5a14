"""A feature's label: the description of its best explanation (``FeatureExplanation``), the
one with the highest score, then the newest (an unscored explanation ranks below every
scored one). Monitoring records, /v1's ``millm.sae_activations``, the steering documents,
the feature pages and the UI read labels here, one query per answer whatever the number of
features (``labels_for`` with the indices it shows, or ``labels_for_many`` across SAEs).

An SAE folder's ``feature_labels.json`` (``{"<index>": "label"}``; the demo SAE ships one)
is imported once, as explanations of source ``labels_file``: at registration, or the first
time that SAE's labels are read. ``SAE.labels_file_read`` records that it was, so a label
deleted later does not come back from the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import F, Q

from core.ids import ascii_int
from registry.models import SAE, FeatureExplanation

LABELS_FILE = "feature_labels.json"
# A labels file is one short string per feature; anything bigger is not one.
MAX_LABELS_BYTES = 16 * 2**20
# the SAEs whose labels file this process has seen imported (saves the check's query)
_imported: set[str] = set()


def _best_order() -> list[Any]:
    return ["sae_id", "index", F("score").desc(nulls_last=True), "-created_at", "-id"]


def labels_for(sae_id: str, indices: Iterable[int] | None = None) -> dict[int, str]:
    """``{index: label}`` of ``sae_id``'s features that have an explanation (of
    ``indices`` only, when given). One query (after the first read of an SAE, which
    imports its labels file)."""
    return labels_for_many({sae_id: indices}).get(sae_id, {})


def labels_for_many(wanted: Mapping[str, Iterable[int] | None]) -> dict[str, dict[int, str]]:
    """``{sae_id: {index: label}}`` for several SAEs at once, in one query (a value of
    None: every labelled feature of that SAE)."""
    cond = Q()
    asked = False
    for sae_id, indices in wanted.items():
        if not sae_id:
            continue
        ensure_labels_file(sae_id)
        if indices is None:
            cond |= Q(sae_id=sae_id)
            asked = True
            continue
        chosen = sorted({int(i) for i in indices if isinstance(i, int) and not isinstance(i, bool) and i >= 0})
        if chosen:
            cond |= Q(sae_id=sae_id, index__in=chosen)
            asked = True
    out: dict[str, dict[int, str]] = {}
    if not asked:
        return out
    rows = FeatureExplanation.objects.filter(cond).order_by(*_best_order())
    for sae_id, index, description in rows.values_list("sae_id", "index", "description").iterator():
        # best first within each feature: the first row of a feature is its label
        out.setdefault(sae_id, {}).setdefault(index, description)
    return out


def explanations_for(sae_id: str, index: int) -> list[dict[str, Any]]:
    """Every explanation of one feature, best first (the first is its label)."""
    ensure_labels_file(sae_id)
    rows = FeatureExplanation.objects.filter(sae_id=sae_id, index=index).order_by(*_best_order())
    return [explanation_out(r) for r in rows]


def explanation_out(row: FeatureExplanation) -> dict[str, Any]:
    return {
        "id": row.id,
        "sae_id": row.sae_id,
        "index": row.index,
        "description": row.description,
        "source": row.source,
        "explainer_model": row.explainer_model or None,
        "score": row.score,
        "score_detail": row.score_detail or None,
        "provenance": row.provenance or {},
        "created_by": row.created_by or None,
        "created_at": row.created_at.isoformat().replace("+00:00", "Z"),
    }


# --------------------------------------------------------------------------- labels file


def read_labels_file(local_path: str, d_sae: int | None = None) -> dict[int, str]:
    """``{index: label}`` from the SAE folder's feature_labels.json: entries whose key is
    not a non-negative integer (below d_sae) or whose value is not a non-empty string are
    left out; no file, an unreadable or oversized one: nothing."""
    if not local_path:
        return {}
    folder = Path(local_path)
    if folder.is_file():
        folder = folder.parent
    path = folder / LABELS_FILE
    try:
        if not path.is_file() or path.stat().st_size > MAX_LABELS_BYTES:
            return {}
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[int, str] = {}
    for key, value in raw.items():
        index = ascii_int(key)
        if index is None or index < 0 or (d_sae is not None and index >= d_sae):
            continue
        if isinstance(value, str) and value.strip():
            out[index] = value.strip()
    return out


def ensure_labels_file(sae_id: str) -> None:
    """Import ``sae_id``'s feature_labels.json once (no-op after, and for an unknown SAE)."""
    if sae_id in _imported:
        return
    if SAE.objects.filter(pk=sae_id, labels_file_read=False).exists():
        import_labels_file(sae_id)
    _imported.add(sae_id)


@transaction.atomic
def import_labels_file(sae_id: str) -> int:
    """The labels file's entries as ``labels_file`` explanations; how many. Locks the row,
    so two first reads at once import it once."""
    sae = SAE.objects.select_for_update().filter(pk=sae_id).first()
    if sae is None or sae.labels_file_read:
        return 0
    labels = read_labels_file(sae.local_path, sae.d_sae) if not sae.is_vector else {}
    FeatureExplanation.objects.bulk_create(
        [
            FeatureExplanation(
                sae=sae,
                index=index,
                description=label,
                source=FeatureExplanation.Source.LABELS_FILE,
                provenance={"file": LABELS_FILE},
            )
            for index, label in sorted(labels.items())
        ],
        batch_size=1000,
    )
    SAE.objects.filter(pk=sae.pk).update(labels_file_read=True)
    return len(labels)


def forget_imported(sae_id: str | None = None) -> None:
    """Drop this process's memory of imported labels files (tests; a deleted SAE)."""
    if sae_id is None:
        _imported.clear()
    else:
        _imported.discard(sae_id)
