"""Explanations of SAE features: written by a user, imported from Neuronpedia's export form,
exported in the same form, deleted. The explainer model's (``features.explainer``) are
stored through ``explanation_store``. A feature's label is its best explanation
(``registry.labels``).

Neuronpedia's export form: a JSON array (or JSONL, one object a line, or an object holding
the array under ``explanations``) of rows ``{modelId, layer, index, description,
explanationModelName?, typeName?, scores?}``; ``layer`` is Neuronpedia's source id
("12-res-jb"), also accepted as ``saeId`` or ``source``; ``index`` an integer or a string
of digits. A row for another model or source than the SAE's ``neuronpedia_id``
("model/source") is skipped and counted; a row with neither is taken as this SAE's (a plain
``[{index, description}]`` list). A malformed row refuses the whole import (422 naming the
row, nothing stored).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.utils import timezone

from audit.services import audited, kwargs_of
from core.errors import InvalidFeatureIndex, MillmError, ValidationFailed
from registry import labels
from registry.errors import SAENotFound
from registry.models import SAE, FeatureExplanation

# an import's bytes (a Neuronpedia export of one 16k-feature SAE is a few MiB)
MAX_IMPORT_BYTES = 16 * 2**20
MAX_ROWS = 200_000
MAX_DESCRIPTION_CHARS = 2000
MAX_INDEX = 2**31 - 1  # the column's range
EXPLANATION_FORMATS = ("json", "jsonl")


class PayloadTooLarge(MillmError):
    code, status = "PAYLOAD_TOO_LARGE", 413


class ExplanationNotFound(MillmError):
    code, status = "EXPLANATION_NOT_FOUND", 404


def sae_for_explanations(sae_id: str) -> SAE:
    sae = SAE.objects.filter(pk=sae_id).first()
    if sae is None:
        raise SAENotFound(f"SAE {sae_id!r} not found", details={"sae_id": sae_id})
    return sae


def check_index(sae: SAE, index: int, *, param: str = "index") -> None:
    """An index of this SAE's dictionary, or 400 INVALID_FEATURE_INDEX naming it."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0 or (sae.d_sae and index >= sae.d_sae):
        raise InvalidFeatureIndex(
            f"{param}: feature {index} is not a feature of SAE {sae.id} (d_sae {sae.d_sae})",
            details={"param": param, "index": index, "d_sae": sae.d_sae, "sae_id": sae.id},
        )


def _clean_description(value: Any, *, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationFailed(
            f"{param} must be a non-empty string", details={"fields": {param: ["a non-empty string is required"]}}
        )
    text = " ".join(value.split())
    if len(text) > MAX_DESCRIPTION_CHARS:
        raise ValidationFailed(
            f"{param} is longer than {MAX_DESCRIPTION_CHARS} characters",
            details={"fields": {param: [f"at most {MAX_DESCRIPTION_CHARS} characters"]}},
        )
    return text


def explanation_list(
    *, sae: SAE, index: int | None = None, limit: int = 100, offset: int = 0
) -> tuple[list[dict[str, Any]], int]:
    """An SAE's explanations (one feature's, with ``index``), best first within a feature."""
    labels.ensure_labels_file(sae.id)
    qs = FeatureExplanation.objects.filter(sae=sae)
    if index is not None:
        check_index(sae, index)
        qs = qs.filter(index=index)
    total = qs.count()
    rows = qs.order_by("index", *labels._best_order()[2:])[offset : offset + limit]
    return [labels.explanation_out(r) for r in rows], total


def _sae_target(kwargs: dict[str, Any], _result: Any) -> tuple[str, Any, str]:
    sae = kwargs.get("sae")
    return ("sae", getattr(sae, "pk", ""), getattr(sae, "name", "") or "")


def _explanation_target(kwargs: dict[str, Any], row: Any) -> tuple[str, Any, str]:
    ident = getattr(row, "pk", None) or kwargs.get("explanation_id", "")
    return ("explanation", ident, getattr(kwargs.get("sae"), "pk", ""))


@audited("explanation.create", _explanation_target, params=kwargs_of("index"))
def explanation_create(*, sae: SAE, index: int, description: str, created_by: str = "") -> FeatureExplanation:
    """A user's explanation of one feature."""
    check_index(sae, index)
    return FeatureExplanation.objects.create(
        sae=sae,
        index=index,
        description=_clean_description(description, param="description"),
        source=FeatureExplanation.Source.USER,
        created_by=created_by[:200],
    )


def explanation_store(
    *,
    sae: SAE,
    index: int,
    description: str,
    source: str,
    explainer_model: str = "",
    provenance: dict[str, Any] | None = None,
    score: float | None = None,
    score_detail: dict[str, Any] | None = None,
    created_by: str = "",
) -> FeatureExplanation:
    check_index(sae, index)
    return FeatureExplanation.objects.create(
        sae=sae,
        index=index,
        description=description,
        source=source,
        explainer_model=explainer_model[:300],
        provenance=provenance or {},
        score=score,
        score_detail=score_detail or {},
        created_by=created_by[:200],
    )


@audited("explanation.delete", _explanation_target)
def explanation_delete(*, sae: SAE, explanation_id: int) -> None:
    deleted, _ = FeatureExplanation.objects.filter(sae=sae, pk=explanation_id).delete()
    if not deleted:
        raise ExplanationNotFound(
            f"SAE {sae.id} has no explanation {explanation_id}",
            details={"sae_id": sae.id, "explanation_id": explanation_id},
        )


# --------------------------------------------------------------------------- import


def _refuse(row: int, message: str) -> ValidationFailed:
    return ValidationFailed(f"row {row}: {message}", details={"row": row, "fields": {f"rows[{row}]": [message]}})


def parse_rows(data: bytes) -> list[Any]:
    """The rows of an export: a JSON array, an object with ``explanations``, or JSONL.
    A row number (1-based) names a line of JSONL or an element of the array."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValidationFailed(
            "The explanations file is not UTF-8 text", details={"fields": {"file": ["not UTF-8 text"]}}
        ) from exc
    if not text.strip():
        raise ValidationFailed("The explanations file is empty", details={"fields": {"file": ["empty"]}})
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    except RecursionError as exc:
        raise ValidationFailed(
            "The explanations file is nested too deeply", details={"fields": {"file": ["nested too deeply"]}}
        ) from exc
    if isinstance(whole, dict) and isinstance(whole.get("explanations"), list):
        whole = whole["explanations"]
    if isinstance(whole, list):
        rows = whole
    elif isinstance(whole, dict):
        rows = [whole]  # a JSONL file of one line
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except (ValueError, RecursionError) as exc:
                raise _refuse(number, "not a JSON object (neither a JSON array nor JSONL)") from exc
        if len(rows) > MAX_ROWS:
            raise ValidationFailed(
                f"More than {MAX_ROWS} rows", details={"fields": {"file": [f"at most {MAX_ROWS} rows"]}}
            )
        return rows
    if len(rows) > MAX_ROWS:
        raise ValidationFailed(f"More than {MAX_ROWS} rows", details={"fields": {"file": [f"at most {MAX_ROWS} rows"]}})
    return list(enumerate(rows, start=1))


def _source_of(row: dict[str, Any], number: int) -> tuple[str, str] | None:
    """The row's (model, source), or None when it names neither."""
    model = row.get("modelId", row.get("model_id"))
    source = next((row[k] for k in ("layer", "saeId", "sae_id", "source") if row.get(k) not in (None, "")), None)
    if model in (None, "") and source is None:
        return None
    if not isinstance(model, str) or not isinstance(source, (str, int)) or isinstance(source, bool):
        raise _refuse(number, "modelId and layer (or saeId) must be strings")
    return model.strip(), str(source).strip()


def _index_of(row: dict[str, Any], number: int) -> int:
    raw = row.get("index", row.get("feature", row.get("featureIndex")))
    if isinstance(raw, bool):
        raw = None
    if isinstance(raw, str) and raw.strip().isascii() and raw.strip().isdigit():
        raw = int(raw.strip())
    if not isinstance(raw, int) or raw < 0 or raw > MAX_INDEX:
        raise _refuse(number, "index must be a non-negative integer (or a string of digits)")
    return raw


def _score_of(row: dict[str, Any]) -> float | None:
    value = row.get("score")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@audited(
    "explanation.import",
    _sae_target,
    params=lambda kw: {
        "neuronpedia_id": kw.get("neuronpedia_id", ""),
        "filename": kw.get("filename", ""),
        "bytes": len(kw.get("data") or b""),
    },
)
def explanations_import(
    *, sae: SAE, data: bytes, neuronpedia_id: str = "", created_by: str = "", filename: str = ""
) -> dict[str, Any]:
    """Store an export's rows for ``sae`` (all or nothing); rows for another
    model/source are skipped and counted, rows already stored (same index, description
    and explainer model) are not stored twice. ``neuronpedia_id`` ("model/source") picks
    the rows of an SAE that has none recorded."""
    if len(data) > MAX_IMPORT_BYTES:
        raise PayloadTooLarge(
            f"The explanations file is larger than {MAX_IMPORT_BYTES} bytes", details={"limit_bytes": MAX_IMPORT_BYTES}
        )
    target = (neuronpedia_id or sae.neuronpedia_id or "").strip()
    if target and "/" not in target:
        raise ValidationFailed(
            "neuronpedia_id must be model/source", details={"fields": {"neuronpedia_id": ["model/source"]}}
        )
    want_model, _, want_source = target.partition("/")
    parsed = []
    sources: set[tuple[str, str]] = set()
    skipped = 0
    for number, row in parse_rows(data):
        if not isinstance(row, dict):
            raise _refuse(number, "not a JSON object")
        index = _index_of(row, number)
        description = row.get("description", row.get("explanation", row.get("label")))
        if not isinstance(description, str) or not description.strip():
            raise _refuse(number, "description must be a non-empty string")
        description = " ".join(description.split())
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise _refuse(number, f"description is longer than {MAX_DESCRIPTION_CHARS} characters")
        origin = _source_of(row, number)
        if origin is not None:
            if target and origin != (want_model, want_source):
                skipped += 1
                continue
            sources.add(origin)
        if sae.d_sae and index >= sae.d_sae:
            raise InvalidFeatureIndex(
                f"row {number}: feature {index} is not a feature of SAE {sae.id} (d_sae {sae.d_sae})",
                details={"row": number, "index": index, "d_sae": sae.d_sae, "sae_id": sae.id},
            )
        model_name = row.get("explanationModelName")
        parsed.append((number, index, description, model_name if isinstance(model_name, str) else "", row))
    if not target and len(sources) > 1:
        names = sorted(f"{m}/{s}" for m, s in sources)
        raise ValidationFailed(
            f"The file holds explanations of {len(names)} Neuronpedia SAEs and SAE {sae.id} has no "
            "neuronpedia_id: name the one to import with neuronpedia_id",
            details={"fields": {"neuronpedia_id": ["required: the file names several SAEs"]}, "found": names[:20]},
        )
    now = timezone.now().isoformat().replace("+00:00", "Z")
    with transaction.atomic():
        sae = SAE.objects.select_for_update().get(pk=sae.pk)
        existing = set(
            FeatureExplanation.objects.filter(sae=sae).values_list("index", "description", "explainer_model")
        )
        new = []
        duplicates = 0
        for number, index, description, model_name, row in parsed:
            key = (index, description, model_name[:300])
            if key in existing:
                duplicates += 1
                continue
            existing.add(key)
            provenance: dict[str, Any] = {"imported_at": now, "row": number}
            if filename:
                provenance["file"] = filename[:200]
            for name in ("modelId", "layer", "typeName", "authorId", "scores", "millmSource"):
                if name in row and row[name] not in (None, "", []):
                    provenance[name] = _kept(row[name])
            new.append(
                FeatureExplanation(
                    sae=sae,
                    index=index,
                    description=description,
                    source=FeatureExplanation.Source.NEURONPEDIA,
                    explainer_model=model_name[:300],
                    provenance={k: v for k, v in provenance.items() if v is not None},
                    score=_score_of(row),
                    score_detail=(_kept(row["scoreDetail"]) or {}) if isinstance(row.get("scoreDetail"), dict) else {},
                    created_by=created_by[:200],
                )
            )
        FeatureExplanation.objects.bulk_create(new, batch_size=1000)
    return {
        "sae_id": sae.id,
        "imported": len(new),
        "duplicates": duplicates,
        "skipped": skipped,
        "neuronpedia_id": target or None,
    }


def _kept(value: Any) -> Any:
    """A row's field kept in provenance: a string cut to 300 characters, anything else
    only when its JSON is at most 4 KiB (None: dropped)."""
    if isinstance(value, str):
        return value[:300]
    return value if len(json.dumps(value, default=str)) <= 4096 else None


# --------------------------------------------------------------------------- export


def export_rows(sae: SAE) -> Iterable[dict[str, Any]]:
    """Every explanation of ``sae`` as a Neuronpedia export row (plus miLLM's
    ``millmSource``, ``score`` and ``scoreDetail``), by index, best first."""
    labels.ensure_labels_file(sae.id)
    model, _, source = (sae.neuronpedia_id or "").partition("/")
    if not model:
        model, source = sae.trained_on_model or "", sae.id
    rows = FeatureExplanation.objects.filter(sae=sae).order_by("index", *labels._best_order()[2:])
    for row in rows.iterator():
        yield {
            "modelId": model,
            "layer": source,
            "index": str(row.index),
            "description": row.description,
            "explanationModelName": row.explainer_model or None,
            "typeName": (row.provenance or {}).get("typeName") or f"millm_{row.source}",
            "score": row.score,
            "scoreDetail": row.score_detail or None,
            "millmSource": row.source,
            "createdAt": row.created_at.isoformat().replace("+00:00", "Z"),
        }


def export_bytes(sae: SAE, fmt: str) -> bytes:
    rows = list(export_rows(sae))
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    return json.dumps(rows, ensure_ascii=False, indent=1).encode()
