"""Probes on a request (docs/monitoring.md, "Probes"): which probes a /v1 request scores
(``probe_request_plan``: those it names, else the armed set), the monitors and capture
they add to its engine jobs, their scores on a finished choice, the
``X-miLLM-Probe-Verdicts`` header and the probe history. The probes themselves (their
definitions, validation and arming) are ``monitoring.probes``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from django.db import transaction
from django.utils import timezone

from core import events
from gpu_engine.api.analysis import CaptureNeed
from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import (
    ActivationRecord,
    EngineStatus,
    FinishEvent,
    MonitorEntry,
    TokenEvent,
)
from monitoring.errors import ProbeScoreRequestInvalid, UnvalidatedProbe
from monitoring.models import Probe, ProbeVerdict
from monitoring.ownership import ANONYMOUS, EVERYONE, Scope
from monitoring.probes import ProbeHead, armed_copy, probe_get
from monitoring.selectors import verdict_out
from monitoring.services import take_records

log = structlog.get_logger(__name__)

PROBE_TAG = "probe"
MAX_REQUEST_PROBES = 8
MAX_SCORE_INPUTS = 64  # the original's PROBE_SCORE_MAX_INPUTS (POST /api/probes/score)
MAX_VERDICT_HISTORY = 10_000
# a probe's monitor reads the stream the next block sees, as a capture does
READ_POINT = "post_steering"


@dataclass
class ProbePlan:
    """The probes one /v1 request scores, and those it reports as not scored."""

    heads: list[ProbeHead]
    skipped: list[ProbeHead] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def monitor_entries(self, positions: str = "completion") -> list[MonitorEntry]:
        """One entry per SAE attachment: the union of its probes' features (only those
        columns are encoded), every row of ``positions`` (a generation's ``completion``
        rows; a scoring pass's ``prompt`` rows)."""
        by_key: dict[tuple[str, int], set[int]] = {}
        for h in self.heads:
            if h.basis == "sae_features":
                by_key.setdefault((h.sae_id, h.layer), set()).update(h.features)
        return [
            MonitorEntry(
                sae_id=s,
                layer=layer,
                top_k=0,
                features=sorted(f),
                read_point=READ_POINT,
                positions=positions,
                stream=False,
                tag=PROBE_TAG,
            )
            for (s, layer), f in sorted(by_key.items())
        ]

    def capture_need(self, positions: str = "completion") -> CaptureNeed | None:
        layers = sorted({h.layer for h in self.heads if h.basis == "hidden_states"})
        return CaptureNeed(layers=tuple(layers), positions=positions) if layers else None

    @property
    def hidden(self) -> list[ProbeHead]:
        return [h for h in self.heads if h.basis == "hidden_states"]


def _ask_ref(ask: Any) -> tuple[str, str | None]:
    if isinstance(ask, str):
        return ask, None
    return ask.name, ask.positions


def probe_request_plan(
    *,
    asked: Sequence[Any] | None,
    status: EngineStatus,
    choices: int,
    armed: tuple[ProbeHead, ...] | None = None,
    scope: Scope = EVERYONE,
) -> ProbePlan | None:
    """The probes a request scores: those it names (``probes``), refused as a whole
    before any forward when one is unknown, unvalidated or cannot be read for this
    request; else the armed set (``armed``; read from the database when None), where
    such a probe is reported as not scored instead."""
    if asked is None:
        if armed is None:
            armed = armed_copy.read()
        if not armed:
            return None
        plan = ProbePlan([])
        for h in armed:
            reason = None
            if not h.current(status):
                reason = "unvalidated"
            elif h.basis == "hidden_states" and choices != 1:
                reason = "several_choices"
            if reason:
                plan.skipped.append(h)
                plan.reasons.append(reason)
            else:
                plan.heads.append(h)
        return plan
    if not asked:
        return None  # ``probes: []``: explicitly none, armed ones included
    if len(asked) > MAX_REQUEST_PROBES:
        raise ProbeScoreRequestInvalid(f"at most {MAX_REQUEST_PROBES} probes per request", details={"param": "probes"})
    rows: list[tuple[Probe, str | None]] = []
    for ask in asked:  # the request's shape first, then each probe
        ref, positions = _ask_ref(ask)
        row = probe_get(ref=ref, scope=scope)  # a request names its owner's probes
        if any(r.id == row.id for r, _ in rows):
            raise ProbeScoreRequestInvalid(f"probe {row.name!r} is named twice", details={"param": "probes"})
        rows.append((row, positions))
    heads: list[ProbeHead] = []
    for row, positions in rows:
        head = ProbeHead.of(row, positions)
        if not head.current(status):
            raise UnvalidatedProbe(
                f"probe {row.name!r} is not validated against the resident model",
                details={"param": "probes", "probe": row.id, "next_step": f"/api/probes/{row.id}/validate"},
            )
        if head.basis == "hidden_states" and choices != 1:
            raise ProbeScoreRequestInvalid(
                f"hidden-state probe {row.name!r} reads one choice's capture: send one prompt with n = 1",
                details={"param": "probes"},
            )
        heads.append(head)
    return ProbePlan(heads)


def _ours(record: ActivationRecord) -> bool:
    return record.tag == PROBE_TAG


def probe_take_records(*, finish: FinishEvent, tokens: Sequence[TokenEvent] = ()) -> list[ActivationRecord]:
    """Remove the probes' records from a finished generation (the request's own
    ``return_sae_activations`` never sees them) and return them."""
    return take_records(_ours, finish=finish, tokens=tokens)


def probe_score_sae(
    *, heads: Sequence[ProbeHead], records: Sequence[ActivationRecord], choice: int
) -> list[dict[str, Any]]:
    out = []
    for h in heads:
        rows = [r for r in records if r.sae_id == h.sae_id and r.layer == h.layer]
        x = np.zeros((len(rows), len(h.features)))
        for i, r in enumerate(rows):
            values = {a.feature_index: a.activation for a in r.features}
            x[i] = [values.get(f, 0.0) for f in h.features]
        out.append(h.verdict(x, choice))
    return out


def probe_score_hidden(
    heads: Sequence[ProbeHead], source: Any, choice: int, rows: str = "completion"
) -> list[dict[str, Any]]:
    """Hidden-state probes on a finished choice's capture (bytes or a file): the
    ``completion`` rows (or, for a scoring pass, the ``prompt`` rows) of each probe's
    layer. Runs in the analysis pool."""
    if source is None:
        return [h.skipped("no_capture", choice) for h in heads]
    capture = load_capture(source)
    n = len(capture.meta["prompt_token_ids"])
    pos = np.asarray(capture.positions)
    keep = pos < n if rows == "prompt" else pos >= n - 1
    out = []
    for h in heads:
        if h.layer not in capture.hidden:
            out.append(h.skipped("no_capture", choice))
            continue
        x = np.asarray(capture.hidden[h.layer], dtype=np.float64)[keep]
        out.append(h.verdict(x, choice))
    return out


def _sf_number(x: float) -> str:
    """An RFC 8941 decimal (at most 3 fractional digits) or integer."""
    text = f"{x:.3f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def verdicts_header(verdicts: Sequence[Mapping[str, Any]]) -> str:
    """``X-miLLM-Probe-Verdicts``: an RFC 8941 list, one item per probe of choice 0, the
    original's shape: ``"toxicity";score=0.93;threshold=0.5;verdict=?1`` (no ``verdict``
    without a threshold), ``"x";not-scored;reason="unvalidated"``."""
    items = []
    for v in verdicts:
        if v.get("choice", 0) != 0:
            continue
        name = str(v["name"]).replace("\\", "\\\\").replace('"', '\\"')
        item = f'"{name}"'
        if not v["scored"]:
            items.append(item + f';not-scored;reason="{v["reason"]}"')
            continue
        item += f";score={_sf_number(v['score'])}"
        if v.get("threshold") is not None:
            item += f";threshold={_sf_number(v['threshold'])}"
            item += ";verdict=" + ("?1" if v["verdict"] else "?0")
        items.append(item)
    return ", ".join(items)


def probe_record(*, request_id: str, verdicts: Sequence[Mapping[str, Any]], owner: str = ANONYMOUS) -> int:
    """The verdicts in the probe history (``/api/monitoring/history``'s
    ``probe_verdicts``) and one ``probe:verdict`` event each; never raises into the
    request (a failure is logged)."""
    if not verdicts:
        return 0
    try:
        now = timezone.now()
        rows = [
            ProbeVerdict(
                timestamp=now,
                request_id=request_id,
                choice=int(v.get("choice", 0)),
                probe_id=v["probe_id"],
                name=v["name"],
                scored=bool(v["scored"]),
                reason=v.get("reason", ""),
                score=v.get("score"),
                threshold=v.get("threshold"),
                verdict=v.get("verdict"),
                positions=v["positions"],
                rows=int(v.get("rows", 0)),
                owner=owner,
            )
            for v in verdicts
        ]
        with transaction.atomic():
            ProbeVerdict.objects.bulk_create(rows)
            # bounded per owner: one key's traffic never evicts another's history
            mine = ProbeVerdict.objects.filter(owner=owner)
            cutoff = list(
                mine.order_by("-id").values_list("id", flat=True)[MAX_VERDICT_HISTORY : MAX_VERDICT_HISTORY + 1]
            )
            if cutoff:
                mine.filter(id__lte=cutoff[0]).delete()
        for row in rows:  # to the request's owner's sockets (and admins') only
            events.publish("probe:verdict", {**verdict_out(row), events.OWNER_FIELD: owner})
        return len(rows)
    except Exception:  # noqa: BLE001 - a probe observes; it never fails the generation
        log.warning("probe_record_failed", request_id=request_id, exc_info=True)
        return 0
