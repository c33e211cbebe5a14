"""``return_sae_activations``: from the request field to the engine's ``MonitorSpec``,
and from the engine's activation records to the ``millm.sae_activations`` object.

Served per request by the engine's monitor hooks (SPEC §3): the records belong to this
request only, read at ``post_steering`` by default (after this layer's steering delta).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from core.errors import MillmError
from gpu_engine.api.protocol import (
    ActivationRecord,
    AttachmentStatus,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
)
from inference.protocol import MAX_ACTIVATION_ENTRIES, ReturnSaeActivations
from steering.rules import check_indices
from steering.selectors import attachment_choices, attachment_pick


class SAEActivationsRefused(MillmError):
    code, status = "SAE_ACTIVATIONS_REFUSED", 400


def monitor_resolve(
    *, asked: ReturnSaeActivations, attachments: Sequence[AttachmentStatus], choices: int, max_tokens: int | None
) -> tuple[MonitorSpec, AttachmentStatus]:
    """The monitor spec for a request's ``return_sae_activations``, or a refusal before
    anything is generated."""
    param = "return_sae_activations"
    if choices > 1:
        raise SAEActivationsRefused(
            "return_sae_activations needs a single choice (n = 1 and one prompt): there is "
            "no single position axis otherwise",
            details={"param": param},
        )
    try:
        att = attachment_pick(attachments=attachments, sae_id=asked.sae_id, param=f"{param}.sae_id")
    except MillmError as exc:
        raise SAEActivationsRefused(
            exc.message, details={"param": f"{param}.sae_id", "choices": attachment_choices(attachments)}
        ) from exc
    features = list(asked.features or [])
    try:
        check_indices(sae_id=att.sae_id, d_sae=att.d_sae, indices=features, param=f"{param}.features")
    except MillmError as exc:  # the same rule, answered as this field's refusal
        raise SAEActivationsRefused(exc.message, details=exc.details) from exc
    positions: Any = asked.positions
    rows: int | None = None
    if isinstance(positions, str):
        if positions == "last":
            rows = 1
        elif positions == "completion":
            rows = max_tokens
    else:
        rows = positions.end - positions.start
        positions = PositionRange(positions.start, positions.end)
    per_row = asked.top_k + len(features)
    if rows is not None and rows * per_row > MAX_ACTIVATION_ENTRIES:
        raise SAEActivationsRefused(
            f"return_sae_activations could return {rows * per_row} entries; the limit is {MAX_ACTIVATION_ENTRIES}",
            details={"param": param},
        )
    entry = MonitorEntry(
        sae_id=att.sae_id,
        layer=att.layer,
        top_k=asked.top_k,
        features=features,
        read_point=asked.read_point,
        positions=positions,
        stream=False,
    )
    return MonitorSpec([entry]), att


def _pairs(items: Sequence[Any], labels: Mapping[int, str]) -> list[dict[str, Any]]:
    out = []
    for a in items:
        pair = {"feature_index": a.feature_index, "activation": a.activation}
        label = labels.get(a.feature_index)
        if label is not None:
            pair["label"] = label
        out.append(pair)
    return out


def _own(records: Iterable[ActivationRecord], attachment: AttachmentStatus) -> list[ActivationRecord]:
    """The records ``millm.sae_activations`` reports: the attachment's, not packed."""
    return [r for r in records if r.sae_id == attachment.sae_id and r.layer == attachment.layer and r.packed is None]


def reported_features(records: Iterable[ActivationRecord], attachment: AttachmentStatus) -> set[int]:
    """Every feature index the payload will name (whose labels it carries)."""
    return {a.feature_index for r in _own(records, attachment) for a in (*r.top_k, *r.features)}


def activations_payload(
    *,
    records: Sequence[ActivationRecord],
    attachment: AttachmentStatus,
    read_point: str,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    prompt_tokens: Sequence[str],
    tokens: Sequence[str],
    labels: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """``millm.sae_activations``: one entry per position read, with the token at that
    position (the one the residual row was computed for) and its text, as the engine's
    tokenizer reads it; a feature entry carries ``label`` when the feature has one
    (``labels``: read before, off the event loop, by ``inference.outcomes.label_activations``)."""
    labels = labels or {}
    texts = [*prompt_tokens, *tokens]
    n_prompt = len(prompt_ids)
    rows = []
    # another attachment's records, and packed (dashboard) ones, are not reported
    for rec in sorted(_own(records, attachment), key=lambda r: r.position):
        pos = rec.position
        if pos < n_prompt:
            token_id = prompt_ids[pos]
        elif pos - n_prompt < len(token_ids):
            token_id = token_ids[pos - n_prompt]
        else:
            token_id = None
        rows.append(
            {
                "position": pos,
                "token_id": token_id,
                "token": texts[pos] if token_id is not None and pos < len(texts) else None,
                "completion_token_index": rec.token_index,
                "top_k": _pairs(rec.top_k, labels),
                "features": _pairs(rec.features, labels),
            }
        )
    return {
        "sae_id": attachment.sae_id,
        "layer": attachment.layer,
        "read_point": read_point,
        "prompt_tokens": n_prompt,
        "positions": rows,
    }
