"""Probes (issue 15, item 4; docs/monitoring.md, "Probes"): trained linear read-outs
scored on /v1 generations, inside the engine's batches.

A probe is ``score = ((x - norm_mean) / norm_std) · weights + bias`` per residual row,
where ``x`` is either the activations of chosen features of the SAE attached at its
layer (basis ``sae_features``) or block ``layer``'s hidden state (basis
``hidden_states``); the rows are the completion's (row ``P-1+i`` produced token ``i``)
and ``positions`` reduces their scores: ``last`` (the row that produced the last token),
``mean`` or ``max``. The verdict is ``score >= threshold`` (none without a threshold).
Scoring given inputs without a generation (``POST /api/probes/score``,
``inference.probe_scoring``) reads the input's own rows (``prompt``) the same way.

How it runs without a serial fallback: an SAE-feature probe adds a ``MonitorEntry``
(tag ``probe``, the probe's features only, so the engine encodes just those columns with
``encode_selected``) to the request's monitor spec; a hidden-state probe adds its layer
to the request's capture (completion rows). Both are read per request inside shared
forward passes by the engine's hooks; the linear score is numpy in the web tier after
the choice finishes (microseconds: a dot product per row), hidden states in the analysis
pool since they come as a capture artifact.

A probe is validated against the resident model (and the SAE at its layer) before it can
be armed or used: dims, layer, d_model / d_sae. A validation names the model it was made
against; loading another model (or attaching another SAE) makes the probe unvalidated
again, and an unvalidated probe is refused (``UNVALIDATED_PROBE``) when a request names
it, and skipped with ``reason: unvalidated`` when it is armed globally.

This module holds the probes themselves (definitions, files, validation, arming, the
armed set); what a request does with them (its plan, the scores, the verdicts and their
history) is ``monitoring.probe_requests``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.services import audited, kwargs_of
from core.errors import ModelNotLoaded
from core.process_copy import ProcessCopy
from gpu_engine.api.archives import ArchiveRefused, read_npz
from gpu_engine.api.protocol import (
    EngineStatus,
)
from monitoring.errors import (
    ProbeExists,
    ProbeInvalid,
    ProbeLimit,
    ProbeModelMismatch,
    ProbeNotFound,
    UnvalidatedProbe,
)
from monitoring.models import Probe
from monitoring.ownership import ANONYMOUS, EVERYONE, Scope

BASES = ("sae_features", "hidden_states")
POSITIONS = ("last", "mean", "max")
MAX_ARMED = 8  # the original's PROBE_MAX_ARMED
MAX_WEIGHTS = 1 << 16
MAX_FILE_BYTES = 16 << 20
# what an .npz probe may inflate to: its four vectors (weights, features, norm_mean,
# norm_std) at MAX_WEIGHTS float64 values each, and small scalars and names
MAX_NPZ_BYTES = 4 * MAX_WEIGHTS * 8 + (64 << 10)


# --------------------------------------------------------------------------- definitions


def _invalid(message: str, **details: Any) -> ProbeInvalid:
    return ProbeInvalid(message, details=details)


def _vector(data: Mapping[str, Any], key: str, size: int | None = None, *, required: bool = True) -> list[float] | None:
    if key not in data or data[key] is None:
        if required:
            raise _invalid(f"the probe has no {key}", field=key)
        return None
    try:
        v = np.asarray(data[key], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise _invalid(f"{key} must be a list of numbers", field=key) from exc
    if not v.size or not np.isfinite(v).all():
        raise _invalid(f"{key} must hold finite numbers", field=key)
    if size is not None and v.size != size:
        raise _invalid(
            f"{key} has {v.size} values, expected {size} (one per weight)", field=key, expected=size, actual=int(v.size)
        )
    if v.size > MAX_WEIGHTS:
        raise _invalid(f"{key} has {v.size} values; at most {MAX_WEIGHTS}", field=key)
    return v.tolist()


def _scalar(data: Mapping[str, Any], key: str, *, required: bool, integer: bool = False) -> Any:
    value = data.get(key)
    if value is None:
        if required:
            raise _invalid(f"the probe has no {key}", field=key)
        return None
    try:
        arr = np.asarray(value).reshape(-1)
        if arr.size != 1:
            raise ValueError
        item = arr[0].item()
    except (TypeError, ValueError) as exc:
        raise _invalid(f"{key} must be one number", field=key) from exc
    if isinstance(item, bool) or not isinstance(item, (int, float)) or not np.isfinite(item):
        raise _invalid(f"{key} must be one finite number", field=key)
    if integer:
        if int(item) != item or item < 0:
            raise _invalid(f"{key} must be a non-negative integer", field=key)
        return int(item)
    return float(item)


def _text(data: Mapping[str, Any], key: str, default: str = "") -> str:
    value = data.get(key, default)
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0].item() if value.size == 1 else None
    if not isinstance(value, str):
        raise _invalid(f"{key} must be a string", field=key)
    return value


def probe_parse(data: Mapping[str, Any]) -> dict[str, Any]:
    """A definition's fields, checked (``PROBE_INVALID`` naming the first bad field).
    Keys: name, description, basis, sae_id, layer, features (sae_features), weights,
    bias, threshold, norm_mean, norm_std, positions."""
    known = {
        "name",
        "description",
        "basis",
        "sae_id",
        "layer",
        "features",
        "weights",
        "bias",
        "threshold",
        "norm_mean",
        "norm_std",
        "positions",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise _invalid(f"unknown fields {unknown}; known: {sorted(known)}", fields=unknown)
    name = _text(data, "name").strip()
    if not name or len(name) > 120 or name.startswith("prb_"):
        raise _invalid("name must be 1-120 characters and not start with 'prb_'", field="name")
    basis = _text(data, "basis", "sae_features" if "features" in data else "hidden_states")
    if basis not in BASES:
        raise _invalid(f"basis must be one of {BASES}", field="basis")
    positions = _text(data, "positions", "last")
    if positions not in POSITIONS:
        raise _invalid(f"positions must be one of {POSITIONS}", field="positions")
    weights = _vector(data, "weights")
    assert weights is not None
    n = len(weights)
    features: list[int] = []
    sae_id = ""
    if basis == "sae_features":
        sae_id = _text(data, "sae_id", "")
        if not sae_id:
            raise _invalid("an sae_features probe names its sae_id", field="sae_id")
        try:
            raw = np.asarray(data.get("features"), dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise _invalid("features must be a list of feature indices", field="features") from exc
        if raw.size != n or not np.isfinite(raw).all() or (raw < 0).any() or (raw != np.floor(raw)).any():
            raise _invalid(
                f"features must list {n} feature indices (one per weight)",
                field="features",
                expected=n,
                actual=int(raw.size),
            )
        features = [int(f) for f in raw]
        if len(set(features)) != n:
            raise _invalid("a feature is listed twice", field="features")
    elif data.get("features") not in (None, []):
        raise _invalid("a hidden_states probe has no features", field="features")
    mean = _vector(data, "norm_mean", n, required=False)
    std = _vector(data, "norm_std", n, required=False)
    if (mean is None) != (std is None):
        raise _invalid("norm_mean and norm_std come together", field="norm_std")
    if std is not None and any(s <= 0 for s in std):
        raise _invalid("norm_std must be positive", field="norm_std")
    return {
        "name": name,
        "description": _text(data, "description", ""),
        "basis": basis,
        "sae_id": sae_id,
        "layer": _scalar(data, "layer", required=True, integer=True),
        "features": features,
        "weights": weights,
        "bias": _scalar(data, "bias", required=False) or 0.0,
        "threshold": _scalar(data, "threshold", required=False),
        "norm_mean": mean,
        "norm_std": std,
        "positions": positions,
    }


def probe_file_read(*, filename: str, content: bytes) -> dict[str, Any]:
    """A probe file's definition: JSON (an object) or ``.npz`` (arrays; read with
    ``allow_pickle=False``: an object array is refused, never unpickled)."""
    if len(content) > MAX_FILE_BYTES:
        raise _invalid(f"the file is larger than {MAX_FILE_BYTES} bytes", field="file")
    if filename.endswith(".npz"):
        # every member checked by its .npy header before a byte of it is inflated: a small
        # upload cannot declare gigabytes (gpu_engine.api.archives)
        try:
            return read_npz(content, max_bytes=MAX_NPZ_BYTES)
        except ArchiveRefused as exc:
            raise _invalid(f"not a readable .npz without pickles: {exc.message}", field="file", **exc.details) from exc
    if filename.endswith(".json"):
        try:
            data = json.loads(content.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _invalid(f"not readable JSON: {exc}", field="file") from exc
        if not isinstance(data, dict):
            raise _invalid("a JSON probe is an object", field="file")
        return data
    raise _invalid("a probe file is .json or .npz", field="file")


def _new_id() -> str:
    return "prb_" + uuid.uuid4().hex[:20]


@transaction.atomic
def probe_create(*, definition: Mapping[str, Any], owner: str = ANONYMOUS) -> Probe:
    """A probe owned by ``owner``; names are unique per owner (another key's probe of the
    same name is neither a conflict nor revealed)."""
    fields = probe_parse(definition)
    if Probe.objects.filter(name=fields["name"], owner=owner).exists():
        raise ProbeExists(f"a probe named {fields['name']!r} exists; delete it first", details={"name": fields["name"]})
    try:
        with transaction.atomic():
            return Probe.objects.create(id=_new_id(), owner=owner, **fields)
    except IntegrityError as exc:  # a concurrent create of the same name
        raise ProbeExists(f"a probe named {fields['name']!r} exists", details={"name": fields["name"]}) from exc


def probe_import(*, filename: str, content: bytes, overrides: Mapping[str, Any], owner: str = ANONYMOUS) -> Probe:
    """A probe from a file; form fields (name, sae_id, threshold, …) fill or override the
    file's."""
    data = dict(probe_file_read(filename=filename, content=content))
    data.update({k: v for k, v in overrides.items() if v is not None})
    if "name" not in data:
        data["name"] = filename.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return probe_create(definition=data, owner=owner)


def probe_get(*, ref: str, scope: Scope = EVERYONE) -> Probe:
    """By id, else by name (the caller's own first); another owner's probe is a 404."""
    qs = scope.filter(Probe.objects.all())
    row = (
        qs.filter(id=ref).first()
        or qs.filter(name=ref, owner=scope.owner).first()
        or qs.filter(name=ref).order_by("created_at").first()
    )
    if row is None:
        raise ProbeNotFound(f"no probe {ref!r}", details={"probe": ref})
    return row


@audited("probe.delete", lambda kw, r: ("probe", kw.get("ref", ""), ""))
def probe_delete(*, ref: str, scope: Scope = EVERYONE) -> None:
    row = probe_get(ref=ref, scope=scope)
    row.delete()
    transaction.on_commit(armed_copy.invalidate)


def _mismatches(row: Probe, status: EngineStatus) -> list[dict[str, Any]]:
    out = []
    n = len(row.weights)
    if status.num_layers is not None and row.layer >= status.num_layers:
        out.append({"field": "layer", "expected": f"< {status.num_layers}", "actual": row.layer})
    if row.basis == "hidden_states":
        if status.hidden_size is not None and n != status.hidden_size:
            out.append({"field": "d_model", "expected": status.hidden_size, "actual": n})
        return out
    att = next((a for a in status.attachments if a.sae_id == row.sae_id and a.layer == row.layer), None)
    if att is None:
        out.append(
            {
                "field": "sae_id",
                "expected": f"{row.sae_id} attached at layer {row.layer}",
                "actual": [f"{a.sae_id}@{a.layer}" for a in status.attachments],
            }
        )
        return out
    top = max(row.features) if row.features else -1
    if top >= att.d_sae:
        out.append({"field": "d_sae", "expected": f"> {top}", "actual": att.d_sae})
    return out


def _validation_for(row: Probe, status: EngineStatus) -> dict[str, Any]:
    v: dict[str, Any] = {"model": status.model_id, "layer": row.layer, "d_in": len(row.weights)}
    if row.basis == "sae_features":
        att = next(a for a in status.attachments if a.sae_id == row.sae_id and a.layer == row.layer)
        v.update(sae_id=att.sae_id, d_sae=att.d_sae)
    else:
        v["d_model"] = status.hidden_size
    return v


def is_current(row_validation: Mapping[str, Any], basis: str, sae_id: str, layer: int, status: EngineStatus) -> bool:
    """Whether a validation still describes the resident model (and SAE)."""
    if not row_validation or status.state != "ready" or row_validation.get("model") != status.model_id:
        return False
    if basis == "hidden_states":
        return row_validation.get("d_model") == status.hidden_size
    return any(
        a.sae_id == sae_id and a.layer == layer and a.d_sae == row_validation.get("d_sae") for a in status.attachments
    )


def probe_validate(*, ref: str, status: EngineStatus, scope: Scope = EVERYONE) -> Probe:
    """Check the probe against the resident model and SAE; ``PROBE_MODEL_MISMATCH`` names
    every differing field (the stored validation is cleared: the probe is unvalidated)."""
    row = probe_get(ref=ref, scope=scope)
    if status.state != "ready" or not status.model_id:
        raise ModelNotLoaded("no model is loaded to validate the probe against", details={"probe": row.id})
    mismatches = _mismatches(row, status)
    with transaction.atomic():
        row = Probe.objects.select_for_update().get(pk=row.pk)
        if mismatches:
            row.validation = {}
            row.save(update_fields=["validation", "updated_at"])
        else:
            row.validation = {
                **_validation_for(row, status),
                "checked_at": timezone.now().isoformat().replace("+00:00", "Z"),
            }
            row.save(update_fields=["validation", "updated_at"])
        transaction.on_commit(armed_copy.invalidate)
    if mismatches:
        raise ProbeModelMismatch(
            f"probe {row.name!r} does not fit the resident model: " + ", ".join(m["field"] for m in mismatches),
            details={"probe": row.id, "mismatches": mismatches},
        )
    return row


@audited("probe.arm", lambda kw, r: ("probe", kw.get("ref", ""), ""), params=kwargs_of("armed"))
def probe_arm(*, ref: str, armed: bool, status: EngineStatus) -> Probe:
    """Arm (score on every /v1 request that brings no ``probes``) or disarm. Arming needs
    a validation for the resident model (``UNVALIDATED_PROBE``) and at most
    ``MAX_ARMED`` armed (``PROBE_LIMIT``)."""
    with transaction.atomic():
        row = probe_get(ref=ref)
        row = Probe.objects.select_for_update().get(pk=row.pk)
        if armed and not row.armed:
            if not is_current(row.validation, row.basis, row.sae_id, row.layer, status):
                raise UnvalidatedProbe(
                    f"probe {row.name!r} is not validated against the resident model; "
                    "POST /api/probes/{id}/validate first",
                    details={"probe": row.id, "next_step": f"/api/probes/{row.id}/validate"},
                )
            if Probe.objects.filter(armed=True).count() >= MAX_ARMED:
                raise ProbeLimit(f"{MAX_ARMED} probes are armed already", details={"limit": MAX_ARMED})
        row.armed = armed
        row.save(update_fields=["armed", "updated_at"])
        transaction.on_commit(armed_copy.invalidate)
    return row


def probe_out(row: Probe, status: EngineStatus | None = None) -> dict[str, Any]:
    out = {
        "id": row.id,
        "name": row.name,
        "description": row.description,
        "basis": row.basis,
        "sae_id": row.sae_id or None,
        "layer": row.layer,
        "features": row.features,
        "d_in": len(row.weights),
        "bias": row.bias,
        "threshold": row.threshold,
        "standardised": row.norm_mean is not None,
        "positions": row.positions,
        "armed": row.armed,
        "validation": row.validation or None,
        "owner": row.owner,
        "created_at": row.created_at.isoformat().replace("+00:00", "Z"),
    }
    if status is not None:
        out["validated"] = is_current(row.validation, row.basis, row.sae_id, row.layer, status)
    return out


def probe_list(
    *,
    status: EngineStatus | None = None,
    scope: Scope = EVERYONE,
    status_of: Callable[[Probe], EngineStatus | None] | None = None,
) -> dict[str, Any]:
    """The scope's probes; ``status_of`` gives each probe the status of its own engine
    (several engines), else ``status`` is every probe's."""
    rows = list(scope.filter(Probe.objects.all()))
    return {"probes": [probe_out(r, status_of(r) if status_of else status) for r in rows], "total": len(rows)}


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ProbeHead:
    """A probe as one request scores it (numpy; no row)."""

    id: str
    name: str
    basis: str
    sae_id: str
    layer: int
    features: tuple[int, ...]
    weights: np.ndarray
    bias: float
    threshold: float | None
    mean: np.ndarray | None
    std: np.ndarray | None
    positions: str
    validation: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, row: Probe, positions: str | None = None) -> ProbeHead:
        def arr(v):
            return None if v is None else np.asarray(v, dtype=np.float64)

        return cls(
            row.id,
            row.name,
            row.basis,
            row.sae_id,
            row.layer,
            tuple(row.features),
            np.asarray(row.weights, dtype=np.float64),
            float(row.bias),
            row.threshold,
            arr(row.norm_mean),
            arr(row.norm_std),
            positions or row.positions,
            dict(row.validation or {}),
        )

    def current(self, status: EngineStatus) -> bool:
        return is_current(self.validation, self.basis, self.sae_id, self.layer, status)

    def score(self, x: np.ndarray) -> tuple[float, int]:
        """The reduced score over rows ``x`` (rows, d_in), and how many rows."""
        x = np.asarray(x, dtype=np.float64)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        s = x @ self.weights + self.bias
        if self.positions == "last":
            return float(s[-1]), int(s.shape[0])
        if self.positions == "max":
            return float(s.max()), int(s.shape[0])
        return float(s.mean()), int(s.shape[0])

    def verdict(self, x: np.ndarray, choice: int) -> dict[str, Any]:
        base = self.header()
        if x.shape[0] == 0:
            return {**base, "choice": choice, "scored": False, "reason": "no_rows"}
        score, rows = self.score(x)
        out = {**base, "choice": choice, "scored": True, "score": score, "probability": _logistic(score), "rows": rows}
        if self.threshold is not None:
            out["verdict"] = score >= self.threshold  # a score on the bar fires
        return out

    def header(self) -> dict[str, Any]:
        return {
            "probe_id": self.id,
            "name": self.name,
            "basis": self.basis,
            "layer": self.layer,
            "positions": self.positions,
            "threshold": self.threshold,
        }

    def skipped(self, reason: str, choice: int = 0) -> dict[str, Any]:
        return {**self.header(), "choice": choice, "scored": False, "reason": reason}


def _logistic(score: float) -> float:
    """The score read as a logistic-regression logit (how probes are trained), computed
    without overflow for scores of either sign."""
    if score >= 0:
        return float(1.0 / (1.0 + np.exp(-score)))
    e = float(np.exp(score))
    return e / (1.0 + e)


def _read_armed() -> tuple[ProbeHead, ...]:
    return tuple(ProbeHead.of(r) for r in Probe.objects.filter(armed=True).order_by("name"))


# the armed set every /v1 request without ``probes`` reads, kept in this process
# (core.process_copy: other workers' changes are seen within a second)
armed_copy: ProcessCopy[tuple[ProbeHead, ...]] = ProcessCopy(_read_armed)
