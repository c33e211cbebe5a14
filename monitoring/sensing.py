"""Sensing (issue 15, item 4; docs/monitoring.md, "Sensing"): events when the members of a
cluster or circuit co-fire on a /v1 generation. Sensing observes; it never gates: the
request's tokens are the same with and without it.

Watched documents: the active cluster and the active circuits, always, and the clusters
and circuits armed for sensing (``monitoring.SensingArm``, ``/api/monitoring/sensing``).
A document is watched on a request when the engine holds the attachment of every one of
its members (a cluster's bound SAE and layer; a circuit's serving SAEs when active, else
the registered SAE each ``saes[]`` reference names); otherwise it is not watched.

How it runs: one tagged monitor entry per attachment (tag ``sensing``, the members' features
only, so the engine encodes just those columns; completion rows; ``pre_steering``: what the
model computes before this request's steering at that layer, so an active cluster's own
strengths cannot make it "fire"), read inside the shared batches as the probes' entries
are. After the choice its records are taken out (``return_sae_activations`` and the
monitoring history never see them) and the rule runs in the web tier: a document **fires at
a row** when every member's activation there is above its threshold (the member's
``threshold`` in the imported document, else 0). One ``sensing:cluster`` /
``sensing:circuit`` event per choice and document that fired.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from django.db import IntegrityError, transaction
from django.db.models.signals import post_delete, post_save

from core import events
from core.errors import MillmError, ValidationFailed
from core.process_copy import ProcessCopy
from gpu_engine.api.protocol import (
    ActivationRecord,
    EngineStatus,
    FinishEvent,
    MonitorEntry,
    TokenEvent,
)
from monitoring.models import SensingArm
from monitoring.services import take_records
from steering.circuits import _resolve_sae, circuit_get, layer_members
from steering.clusters import cluster_get, cluster_members
from steering.documents import validate_circuit, validate_cluster
from steering.live import live_copy
from steering.models import Circuit, Cluster

log = structlog.get_logger(__name__)

SENSING_TAG = "sensing"
READ_POINT = "pre_steering"
KINDS = ("cluster", "circuit")
MAX_ARMED = 32


class SensingNotArmed(MillmError):
    """DELETE of a cluster or circuit that is not armed for sensing."""

    code, status = "SENSING_NOT_ARMED", 404


@dataclass(frozen=True)
class SensedMember:
    sae_id: str  # "" when the SAE could not be resolved (the document is not watched)
    layer: int
    feature: int
    threshold: float


@dataclass(frozen=True)
class Watch:
    """One document as sensing reads it (no row)."""

    kind: str
    id: int
    name: str
    source: str  # "active" | "armed"
    members: tuple[SensedMember, ...]

    def held(self, status: EngineStatus) -> bool:
        keys = {(a.sae_id, a.layer, a.d_sae) for a in status.attachments}
        return bool(self.members) and all(
            any(s == m.sae_id and layer == m.layer and m.feature < d for s, layer, d in keys) for m in self.members
        )

    def out(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.id,
            "name": self.name,
            "source": self.source,
            "members": [
                {"sae_id": m.sae_id or None, "layer": m.layer, "feature": m.feature, "threshold": m.threshold}
                for m in self.members
            ],
        }


# --------------------------------------------------------------------------- documents


def _threshold(member: Any) -> float:
    value = (getattr(member, "model_extra", None) or {}).get("threshold")
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


def _cluster_watch(row: Any, source: str) -> Watch:
    thresholds: dict[int, float] = {}
    try:
        definition = validate_cluster(json.loads(row.document))
        thresholds = {m.feature_idx: _threshold(m) for m in definition.members}
    except Exception:  # noqa: BLE001 - a bundle item or an older text: thresholds are 0
        pass
    layer = row.layer if row.layer is not None else -1
    members = tuple(
        SensedMember(row.sae_id or "", layer, m.feature_idx, thresholds.get(m.feature_idx, 0.0))
        for m in cluster_members(row)
    )
    return Watch("cluster", row.pk, row.name, source, members)


def _circuit_watch(row: Any, source: str) -> Watch:
    thresholds: dict[tuple[int, int], float] = {}
    try:
        _, layers = validate_circuit(json.loads(row.document))
        thresholds = {(int(layer), m.feature_idx): _threshold(m) for layer, ms in layers.items() for m in ms}
    except Exception:  # noqa: BLE001 - thresholds are 0
        pass
    saes = {int(layer): sae for layer, sae in (row.serving or {}).items()}
    if not saes:
        for ref in row.saes:
            sae = _resolve_sae(ref)
            if sae is not None:
                saes[int(ref["layer"])] = sae.id
    members = tuple(
        SensedMember(saes.get(layer, ""), layer, m.feature_idx, thresholds.get((layer, m.feature_idx), 0.0))
        for layer, ms in sorted(layer_members(row).items())
        for m in ms
    )
    return Watch("circuit", row.pk, row.name, source, members)


def _read_watches() -> tuple[Watch, ...]:
    out: list[Watch] = []
    seen: set[tuple[str, int]] = set()
    for row in Cluster.objects.filter(is_active=True):
        out.append(_cluster_watch(row, "active"))
        seen.add(("cluster", row.pk))
    for row in Circuit.objects.filter(is_active=True).order_by("name"):
        out.append(_circuit_watch(row, "active"))
        seen.add(("circuit", row.pk))
    arms = list(SensingArm.objects.order_by("created_at", "id"))
    clusters = Cluster.objects.in_bulk([a.object_id for a in arms if a.kind == "cluster"])
    circuits = Circuit.objects.in_bulk([a.object_id for a in arms if a.kind == "circuit"])
    for arm in arms:
        if (arm.kind, arm.object_id) in seen:
            continue
        row = (clusters if arm.kind == "cluster" else circuits).get(arm.object_id)
        if row is None:  # deleted since: nothing to watch
            continue
        out.append((_cluster_watch if arm.kind == "cluster" else _circuit_watch)(row, "armed"))
    return tuple(out)


# the watched set every /v1 request reads, kept in this process (core.process_copy); dropped
# when an arm changes, when a cluster or circuit is saved or deleted, and whenever the live
# steering changes (every activation and deactivation takes steering_lock, which drops
# ``live_copy``: see ``_follow_live``)
watch_copy: ProcessCopy[tuple[Watch, ...]] = ProcessCopy(_read_watches)


def _follow_live() -> None:
    """Every change of the live steering (activations, deactivations) drops the watched set."""
    live_copy.followed_by(watch_copy)


def connect_signals() -> None:
    """Called from ``MonitoringConfig.ready``."""

    def dropped(**_: Any) -> None:
        transaction.on_commit(watch_copy.invalidate)

    for model in (Cluster, Circuit, SensingArm):
        post_save.connect(dropped, sender=model, weak=False, dispatch_uid=f"sensing-{model.__name__}-save")
        post_delete.connect(dropped, sender=model, weak=False, dispatch_uid=f"sensing-{model.__name__}-delete")
    _follow_live()


# --------------------------------------------------------------------------- arming


def _document(kind: Any, ref: Any) -> Any:
    if kind not in KINDS:
        raise ValidationFailed(f"kind must be one of {KINDS}", details={"fields": {"kind": [f"one of {list(KINDS)}"]}})
    if ref is None or isinstance(ref, bool) or (not isinstance(ref, (int, str))) or ref == "":
        raise ValidationFailed(
            "id names the cluster or circuit (its id or name)", details={"fields": {"id": ["required"]}}
        )
    return cluster_get(cluster_id=ref) if kind == "cluster" else circuit_get(circuit_id=ref)


def sensing_arm(*, kind: Any, ref: Any) -> dict[str, Any]:
    """Watch a cluster or circuit (by id or name) on every /v1 generation; arming one that
    is armed already changes nothing. Unknown: ``CLUSTER_NOT_FOUND`` /
    ``CIRCUIT_NOT_FOUND`` (404)."""
    row = _document(kind, ref)
    if SensingArm.objects.count() >= MAX_ARMED and not SensingArm.objects.filter(kind=kind, object_id=row.pk).exists():
        raise ValidationFailed(f"at most {MAX_ARMED} documents are armed for sensing", details={"limit": MAX_ARMED})
    try:
        with transaction.atomic():
            arm, _ = SensingArm.objects.get_or_create(kind=kind, object_id=row.pk)
    except IntegrityError:  # a concurrent arm of the same document
        arm = SensingArm.objects.get(kind=kind, object_id=row.pk)
    return _arm_out(arm, row.name)


def sensing_disarm(*, kind: Any, ref: Any) -> dict[str, Any]:
    """Stop watching; ``SENSING_NOT_ARMED`` (404) when it was not armed. An active cluster
    or circuit stays watched while it is active."""
    row = _document(kind, ref)
    deleted, _ = SensingArm.objects.filter(kind=kind, object_id=row.pk).delete()
    if not deleted:
        raise SensingNotArmed(f"{kind} {row.name!r} is not armed for sensing", details={"kind": kind, "id": row.pk})
    return {"kind": kind, "id": row.pk, "name": row.name, "armed": False}


def _arm_out(arm: SensingArm, name: str | None) -> dict[str, Any]:
    return {
        "kind": arm.kind,
        "id": arm.object_id,
        "name": name,
        "armed": True,
        "armed_at": arm.created_at.isoformat().replace("+00:00", "Z"),
    }


def sensing_list(
    *, status: EngineStatus | None = None, status_of: Callable[[Watch], EngineStatus | None] | None = None
) -> dict[str, Any]:
    """The arms, and every watched document (armed or active) with its members and whether
    the engine holds their attachments now (``status_of``: each document's own engine's
    status, with several engines; else ``status``)."""
    arms = list(SensingArm.objects.order_by("created_at", "id"))
    names = {
        ("cluster", k): v
        for k, v in Cluster.objects.in_bulk([a.object_id for a in arms if a.kind == "cluster"]).items()
    }
    names.update(
        {
            ("circuit", k): v
            for k, v in Circuit.objects.in_bulk([a.object_id for a in arms if a.kind == "circuit"]).items()
        }
    )
    watched = []
    for w in _read_watches():
        item = w.out()
        seen = status_of(w) if status_of is not None else status
        if seen is not None:
            item["watched_now"] = w.held(seen)
        watched.append(item)
    armed = [_arm_out(a, getattr(names.get((a.kind, a.object_id)), "name", None)) for a in arms]
    return {"armed": armed, "watched": watched, "total": len(armed)}


# --------------------------------------------------------------------------- requests


@dataclass
class SensingPlan:
    watches: list[Watch]

    def monitor_entries(self) -> list[MonitorEntry]:
        by_key: dict[tuple[str, int], set[int]] = {}
        for w in self.watches:
            for m in w.members:
                by_key.setdefault((m.sae_id, m.layer), set()).add(m.feature)
        return [
            MonitorEntry(
                sae_id=s,
                layer=layer,
                top_k=0,
                features=sorted(f),
                read_point=READ_POINT,
                positions="completion",
                stream=False,
                tag=SENSING_TAG,
            )
            for (s, layer), f in sorted(by_key.items())
        ]


def sensing_request_plan(
    *, status: EngineStatus | None, watches: tuple[Watch, ...] | None = None
) -> SensingPlan | None:
    """The documents one request watches (those whose attachments the engine holds)."""
    if status is None or status.state != "ready":
        return None
    if watches is None:
        watches = watch_copy.read()
    held = [w for w in watches if w.held(status)]
    return SensingPlan(held) if held else None


def _ours(record: ActivationRecord) -> bool:
    return record.tag == SENSING_TAG


def sensing_take_records(*, finish: FinishEvent, tokens: Sequence[TokenEvent] = ()) -> list[ActivationRecord]:
    """Remove sensing's records from a finished generation and return them."""
    return take_records(_ours, finish=finish, tokens=tokens)


def sensing_detect(
    *, plan: SensingPlan, records: Sequence[ActivationRecord], request_id: str, choice: int
) -> list[tuple[str, dict[str, Any]]]:
    """The events of one choice: ``(name, data)`` per document that fired at some row."""
    table: dict[tuple[str, int, int], dict[int, float]] = {}
    token_index: dict[int, int | None] = {}
    for r in records:
        table[(r.sae_id, r.layer, r.position)] = {a.feature_index: a.activation for a in r.features}
        token_index[r.position] = r.token_index
    out = []
    for w in plan.watches:
        rows = []
        for pos in sorted(token_index):
            values = [table.get((m.sae_id, m.layer, pos), {}).get(m.feature) for m in w.members]
            if all(v is not None and v > m.threshold for v, m in zip(values, w.members)):
                rows.append(pos)
        if not rows:
            continue
        first = rows[0]
        out.append(
            (
                f"sensing:{w.kind}",
                {
                    "kind": w.kind,
                    "id": w.id,
                    "name": w.name,
                    "source": w.source,
                    "request_id": request_id,
                    "choice": choice,
                    "rows": rows,
                    "token_indices": [token_index[p] for p in rows],
                    "members": [
                        {
                            "sae_id": m.sae_id,
                            "layer": m.layer,
                            "feature": m.feature,
                            "threshold": m.threshold,
                            "activation": table[(m.sae_id, m.layer, first)][m.feature],
                        }
                        for m in w.members
                    ],
                },
            )
        )
    return out


def sensing_publish(
    *, plan: SensingPlan, records: Sequence[ActivationRecord], request_id: str, choice: int, owner: str | None = None
) -> int:
    """Detect and publish, to the request's owner's sockets (and admins') when ``owner``
    is given; never raises into the request (a failure is logged)."""
    try:
        found = sensing_detect(plan=plan, records=records, request_id=request_id, choice=choice)
        for name, data in found:
            events.publish(name, data if owner is None else {**data, events.OWNER_FIELD: owner})
        return len(found)
    except Exception:  # noqa: BLE001 - sensing observes; it never fails the generation
        log.warning("sensing_failed", request_id=request_id, exc_info=True)
        return 0
