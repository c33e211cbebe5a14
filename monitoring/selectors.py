"""Monitoring reads: the history (newest first) and statistics computed over it."""

from __future__ import annotations

import math
from typing import Any

from gpu_engine.api.artifacts import file_names, is_capture_id
from monitoring.errors import CaptureNotFound
from monitoring.models import ActivationRecord, Capture, MonitoringConfig, ProbeVerdict
from monitoring.ownership import EVERYONE, Scope
from registry.labels import labels_for_many

METRICS = ("mean", "max", "active_ratio", "count")


def monitoring_config() -> MonitoringConfig:
    config, _ = MonitoringConfig.objects.get_or_create(pk=1)
    return config


def record_out(row: ActivationRecord, labels: dict[int, str] | None = None) -> dict[str, Any]:
    """One history record; each ``{feature_index, activation}`` carries ``label`` when the
    feature has one (``labels``: its SAE's, read once for the whole answer)."""
    labels = labels or {}
    return {
        "timestamp": row.timestamp.isoformat().replace("+00:00", "Z"),
        "request_id": row.request_id,
        "token_position": row.token_position,
        "activations": _labelled(row.activations, labels),
        "top_k": _labelled(row.top_k, labels),
        "sae_id": row.sae_id,
        "layer": row.layer,
        "completion_token_index": row.completion_token_index,
    }


def _labelled(pairs: Any, labels: dict[int, str]) -> Any:
    if not labels or not isinstance(pairs, list):
        return pairs
    out = []
    for pair in pairs:
        label = labels.get(pair.get("feature_index")) if isinstance(pair, dict) else None
        out.append({**pair, "label": label} if label is not None else pair)
    return out


def _record_labels(rows: list[ActivationRecord]) -> dict[str, dict[int, str]]:
    """The labels of every feature the records name, by SAE: one query."""
    wanted: dict[str, set[int]] = {}
    for row in rows:
        for pair in [*(row.activations or []), *(row.top_k or [])]:
            if isinstance(pair, dict) and isinstance(pair.get("feature_index"), int):
                wanted.setdefault(row.sae_id, set()).add(pair["feature_index"])
    return labels_for_many(wanted) if wanted else {}


def verdict_out(row: ProbeVerdict) -> dict[str, Any]:
    out = {
        "timestamp": row.timestamp.isoformat().replace("+00:00", "Z"),
        "request_id": row.request_id,
        "choice": row.choice,
        "probe_id": row.probe_id,
        "name": row.name,
        "scored": row.scored,
        "score": row.score,
        "threshold": row.threshold,
        "verdict": row.verdict,
        "positions": row.positions,
        "rows": row.rows,
    }
    if not row.scored:
        out["reason"] = row.reason
    return out


def capture_dir():  # type: ignore[no-untyped-def]
    from pathlib import Path

    from django.conf import settings

    return Path(settings.CAPTURE_DIR).resolve()


def history(*, limit: int = 50, request_id: str | None = None, scope: Scope = EVERYONE) -> dict[str, Any]:
    qs = scope.filter(ActivationRecord.objects.order_by("-id"))
    if request_id:
        qs = qs.filter(request_id=request_id)
    total = qs.count()
    verdicts = scope.filter(ProbeVerdict.objects.order_by("-id"))
    if request_id:
        verdicts = verdicts.filter(request_id=request_id)
    rows = list(qs[:limit])
    labels = _record_labels(rows)
    return {
        "records": [record_out(r, labels.get(r.sae_id)) for r in rows],
        "total": total,
        "probe_verdicts": [verdict_out(v) for v in verdicts[:limit]],
    }


def _window(scope: Scope):
    config = monitoring_config()
    qs = scope.filter(ActivationRecord.objects.order_by("id"))
    if config.statistics_since is not None:
        qs = qs.filter(timestamp__gte=config.statistics_since)
    return qs, config


def statistics(*, features: list[int] | None = None, scope: Scope = EVERYONE) -> dict[str, Any]:
    """Per feature over the history since the last reset: its value in each record that
    reports it (every record when monitoring named the features; the records where it made
    the top-k when monitoring all) — ``count``, ``mean``, ``std`` (population), ``min``,
    ``max`` and ``active_ratio`` (the share of those values above zero)."""
    qs, config = _window(scope)
    values: dict[int, list[float]] = {}
    total = 0
    saes: set[str] = set()
    for sae_id, activations in qs.values_list("sae_id", "activations").iterator():
        total += 1
        saes.add(sae_id)
        for pair in activations:
            values.setdefault(int(pair["feature_index"]), []).append(float(pair["activation"]))
    wanted = sorted(values) if features is None else sorted(set(features))
    rows = []
    for index in wanted:
        seen = values.get(index, [])
        if not seen:
            rows.append(
                {
                    "feature_idx": index,
                    "count": 0,
                    "mean": None,
                    "std": None,
                    "min": None,
                    "max": None,
                    "active_ratio": None,
                }
            )
            continue
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((v - mean) ** 2 for v in seen) / len(seen))
        rows.append(
            {
                "feature_idx": index,
                "count": len(seen),
                "mean": mean,
                "std": std,
                "min": min(seen),
                "max": max(seen),
                "active_ratio": sum(v > 0 for v in seen) / len(seen),
            }
        )
    if len(saes) == 1 and rows:
        # the labels of the one SAE the records read (records of several: no labels, an
        # index names a different feature in each)
        labels = labels_for_many({next(iter(saes)): [r["feature_idx"] for r in rows]}).get(next(iter(saes)), {})
        for row in rows:
            if row["feature_idx"] in labels:
                row["label"] = labels[row["feature_idx"]]
    since = config.statistics_since
    return {
        "features": rows,
        "total_activations": total,
        "since": since.isoformat().replace("+00:00", "Z") if since else None,
    }


def statistics_top(*, k: int = 10, metric: str = "mean", scope: Scope = EVERYONE) -> dict[str, Any]:
    stats = statistics(scope=scope)
    rows = [r for r in stats["features"] if r["count"]]
    rows.sort(key=lambda r: (-r[metric], r["feature_idx"]))
    return {
        "features": rows[:k],
        "metric": metric,
        "k": k,
        "total_activations": stats["total_activations"],
        "since": stats["since"],
    }


# --------------------------------------------------------------------------- captures


def capture_out(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "request_id": row.request_id,
        "model": row.model,
        "backend": row.backend,
        "layers": row.layers,
        "positions": row.positions,
        "rows": row.rows,
        "dtype": row.dtype,
        "steering_hash": row.steering_hash or None,
        "bytes": row.nbytes,
        "created_at": row.created_at.isoformat(),
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "url": f"/api/captures/{row.id}/download",
        "owner": row.owner,
    }


def live_captures(scope: Scope = EVERYONE) -> Any:
    """The captures ``scope`` sees that have not expired (CAPTURE_RETENTION_S): an expired
    one is gone for every reader at once, before the pruner deletes its files."""
    from django.db.models import Q
    from django.utils import timezone

    return scope.filter(Capture.objects.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())))


def capture_get(*, capture_id: str, scope: Scope = EVERYONE) -> Any:
    """The row, or None for an unknown id, anything that is not 32 hex digits, or another
    owner's capture (the same answer: its existence is not revealed)."""
    if not is_capture_id(capture_id):
        return None
    return live_captures(scope).filter(id=capture_id).first()


def capture_list(*, limit: int = 50, request_id: str | None = None, scope: Scope = EVERYONE) -> dict[str, Any]:
    qs = live_captures(scope).order_by("-created_at")
    if request_id:
        qs = qs.filter(request_id=request_id)
    return {"captures": [capture_out(r) for r in qs[:limit]], "total": qs.count()}


def capture_detail(*, capture_id: str, scope: Scope = EVERYONE) -> dict[str, Any]:
    """The row and the sidecar JSON (CaptureNotFound when either is missing)."""
    import json

    path = capture_file(capture_id=capture_id, sidecar=True, scope=scope)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CaptureNotFound(
            f"capture {capture_id!r} has no readable sidecar", details={"capture_id": capture_id}
        ) from exc
    return {**capture_out(capture_get(capture_id=capture_id, scope=scope)), "metadata": meta}


def capture_file(*, capture_id: str, sidecar: bool = False, scope: Scope = EVERYONE) -> Any:
    """The path of a stored capture's file, only ever inside CAPTURE_DIR."""
    row = capture_get(capture_id=capture_id, scope=scope)
    if row is None:
        raise CaptureNotFound(f"no capture {capture_id!r}", details={"capture_id": capture_id})
    root = capture_dir()
    path = (root / file_names(row.id)[1 if sidecar else 0]).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise CaptureNotFound(f"capture {capture_id!r} has no file", details={"capture_id": capture_id})
    return path
