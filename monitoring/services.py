"""Monitoring services: the configuration, the entry /v1 requests carry, and the history
the generations feed.

How records arrive: while monitoring is enabled, ``monitoring_request_entry`` gives every
/v1 generation a ``pre_steering`` ``MonitorEntry`` on the monitored attachment (the engine
reads it per request, so a record belongs to exactly the request whose tokens made it,
also inside a shared batch). When the generation finishes, ``monitoring_take_records``
takes those records out of the engine's result (the request's own
``return_sae_activations`` never sees them) and ``monitoring_record`` stores them under
the request's response id and publishes ``monitoring:activation``.

``monitoring:activation`` is rate-capped per web process: at most
``EVENTS_PER_SECOND`` (10) events a second, one per recorded generation (its last
record); the history keeps every record whether or not its event was sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from django.db import transaction
from django.utils import timezone

from audit.services import audited, kwargs_of
from core import events
from core.capabilities import require_capability
from core.errors import ValidationFailed
from core.process_copy import ProcessCopy
from gpu_engine.api.artifacts import file_names, is_capture_id
from gpu_engine.api.protocol import (
    ActivationRecord as EngineRecord,
)
from gpu_engine.api.protocol import (
    AttachmentStatus,
    FinishEvent,
    MonitorEntry,
    MonitorSpec,
    TokenEvent,
)
from monitoring.errors import CaptureNotFound
from monitoring.models import ActivationRecord, Capture, MonitoringConfig, ProbeVerdict
from monitoring.ownership import ANONYMOUS, EVERYONE, Scope
from monitoring.selectors import capture_dir, capture_get, monitoring_config
from registry.errors import VectorInvalid
from registry.models import Attachment
from steering.live import attachment_choose, check_indices

log = structlog.get_logger(__name__)

READ_POINT = "pre_steering"
EVENTS_PER_SECOND = 10
MAX_HISTORY = 10_000
MAX_TOP_K = 1000
MAX_FEATURES = 1024


def _pairs(items: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"feature_index": int(a.feature_index), "activation": float(a.activation)} for a in items]


def monitoring_state(scope: Scope = EVERYONE) -> dict[str, Any]:
    """The configuration and what is recorded; ``history_count`` counts the records the
    caller may see (``scope``)."""
    config = monitoring_config()
    attached = list(Attachment.objects.all())
    target = None
    if config.sae_id:
        target = next(
            (a for a in attached if a.sae_id == config.sae_id and (config.layer is None or a.layer == config.layer)),
            None,
        )
    elif len(attached) == 1:
        target = attached[0]
    return {
        "enabled": config.enabled,
        "sae_attached": bool(attached),
        "sae_id": target.sae_id if target else (config.sae_id or None),
        "layer": target.layer if target else config.layer,
        "monitored_features": config.features,
        "history_size": config.history_size,
        "history_count": scope.filter(ActivationRecord.objects.all()).count(),
        "top_k": config.top_k,
        "positions": config.positions,
        "read_point": READ_POINT,
        "statistics_since": config.statistics_since.isoformat().replace("+00:00", "Z")
        if config.statistics_since
        else None,
    }


def _publish_state() -> None:
    # to every socket: the configuration, not how much any key has recorded
    transaction.on_commit(lambda: events.publish("monitoring:state", {**monitoring_state(), "history_count": None}))


def _prune(history_size: int, owner: str | None = None) -> None:
    """Keep the newest ``history_size`` records (of ``owner``'s, when named: one key's
    traffic never evicts another's history)."""
    qs = ActivationRecord.objects.all() if owner is None else ActivationRecord.objects.filter(owner=owner)
    cutoff = list(qs.order_by("-id").values_list("id", flat=True)[history_size : history_size + 1])
    if cutoff:
        qs.filter(id__lte=cutoff[0]).delete()


KEEP: Any = object()  # a configure field the request left out: the current value stays


@audited(
    "monitoring.configure",
    lambda kw, r: ("monitoring", "", ""),
    params=lambda kw: {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str, list, type(None)))},
)
@transaction.atomic
def monitoring_configure(
    *,
    enabled: bool = True,
    features: list[int] | None | Any = KEEP,
    history_size: int | Any = KEEP,
    top_k: int | Any = KEEP,
    positions: str | Any = KEEP,
    sae_id: str | None = None,
    layer: int | None = None,
) -> dict[str, Any]:
    """Choose what /v1 requests record. Needs an attached SAE (the one named, else the
    only one); feature indices are checked against its d_sae. A field left out keeps its
    current value (a fresh configuration: all features, history 100, top-k 10, last
    position), so changing one never resets — and prunes — the rest. Shrinking the history
    keeps the newest records."""
    current = MonitoringConfig.objects.get_or_create(pk=1)[0]
    before = monitoring_state()
    keep_features = features is KEEP
    features = current.features if keep_features else features
    history_size = current.history_size if history_size is KEEP else history_size
    top_k = current.top_k if top_k is KEEP else top_k
    positions = current.positions if positions is KEEP else positions
    if (
        not 1 <= history_size <= MAX_HISTORY
        or not 1 <= top_k <= MAX_TOP_K
        or positions not in MonitoringConfig.Positions.values
    ):
        raise ValidationFailed(
            "history_size 1-10000, top_k 1-1000, positions last, completion or all",
            details={"fields": {"monitoring": ["out of range"]}},
        )
    attachment = attachment_choose(sae_id=sae_id, layer=layer)
    if attachment.sae.format == "vector":
        raise VectorInvalid(
            f"{attachment.sae_id} is a raw steering vector: it has no encoder, so nothing can be monitored with it",
            details={"field": "sae_id", "sae_id": attachment.sae_id},
        )
    if keep_features and (before["sae_id"], before["layer"]) != (attachment.sae_id, attachment.layer):
        features = None  # indices of another SAE mean nothing here: all features
    if features is not None:
        features = sorted({int(f) for f in features})
        if len(features) > MAX_FEATURES:
            raise ValidationFailed(
                f"At most {MAX_FEATURES} features", details={"fields": {"features": [f"at most {MAX_FEATURES}"]}}
            )
        check_indices(attachment=attachment, indices=features, param="features")
    if enabled:  # what every /v1 request will then record
        require_capability("per_request_monitoring", what="SAE monitoring", param="enabled")
    config = MonitoringConfig.objects.select_for_update().get_or_create(pk=1)[0]
    several = sae_id is not None or layer is not None
    config.enabled = bool(enabled)
    config.sae_id = attachment.sae_id if several else ""
    config.layer = attachment.layer if several else None
    config.features = features
    config.history_size, config.top_k, config.positions = history_size, top_k, positions
    config.save()
    transaction.on_commit(request_config.invalidate)
    for owner in ActivationRecord.objects.values_list("owner", flat=True).distinct():
        _prune(history_size, owner)
    _publish_state()
    return monitoring_state()


@audited("monitoring.enable", lambda kw, r: ("monitoring", "", ""), params=kwargs_of("enabled"))
@transaction.atomic
def monitoring_enable(*, enabled: bool) -> dict[str, Any]:
    """Toggle without reconfiguring (the watched features and top-k are kept)."""
    if enabled:
        require_capability("per_request_monitoring", what="SAE monitoring", param="enabled")
    config = MonitoringConfig.objects.select_for_update().get_or_create(pk=1)[0]
    config.enabled = bool(enabled)
    config.save(update_fields=["enabled", "updated_at"])
    transaction.on_commit(request_config.invalidate)
    _publish_state()
    return monitoring_state()


def _whose(scope: Scope) -> str:
    return "all" if scope.all else scope.owner


@audited(
    "monitoring.history_clear",
    lambda kw, r: ("monitoring_history", _whose(kw.get("scope", EVERYONE)), ""),
)
def monitoring_history_clear(*, scope: Scope = EVERYONE) -> int:
    """Clear the history the caller owns (an admin's: everyone's)."""
    deleted, _ = scope.filter(ActivationRecord.objects.all()).delete()
    scope.filter(ProbeVerdict.objects.all()).delete()
    return deleted


@audited("monitoring.statistics_reset", lambda kw, r: ("monitoring", "", ""))
def monitoring_statistics_reset() -> dict[str, Any]:
    """Statistics start again from now (the history itself is kept)."""
    config = monitoring_config()
    config.statistics_since = timezone.now()
    config.save(update_fields=["statistics_since", "updated_at"])
    return monitoring_state()


# --------------------------------------------------------------------------- the /v1 hook


@dataclass(frozen=True)
class RequestConfig:
    """What a /v1 request needs of the monitoring configuration."""

    enabled: bool
    sae_id: str
    layer: int | None
    features: list[int] | None
    top_k: int
    positions: str


def _read_request_config() -> RequestConfig:
    row = MonitoringConfig.objects.filter(pk=1).first()
    if row is None:
        return RequestConfig(False, "", None, None, 0, "last")
    return RequestConfig(row.enabled, row.sae_id, row.layer, row.features, row.top_k, row.positions)


# the configuration every /v1 request reads, kept in this process (core.process_copy)
request_config: ProcessCopy[RequestConfig] = ProcessCopy(_read_request_config)


def monitoring_request_config() -> RequestConfig | None:
    """The configuration as this process last read it, or None when that is too old and
    the database must be read (``monitoring_request_entry`` does)."""
    return request_config.fresh()


def monitoring_request_entry(
    *, attachments: Sequence[AttachmentStatus], config: RequestConfig | None = None
) -> MonitorEntry | None:
    """The entry a /v1 generation carries while monitoring is on (None when it is off or
    the monitored attachment is not held by the engine). Without ``config`` the database
    is read."""
    if config is None:
        config = request_config.read()
    if not config.enabled:
        return None
    if config.sae_id:
        att = next(
            (a for a in attachments if a.sae_id == config.sae_id and (config.layer is None or a.layer == config.layer)),
            None,
        )
    else:
        att = attachments[0] if len(attachments) == 1 else None
    if att is None:
        return None
    features = [f for f in (config.features or []) if f < att.d_sae]
    if config.features is not None and not features:
        return None
    return MonitorEntry(
        sae_id=att.sae_id,
        layer=att.layer,
        top_k=config.top_k,
        features=features,
        read_point=READ_POINT,
        positions=config.positions,
        stream=False,
    )


def monitoring_merge(
    spec: MonitorSpec | None, entry: MonitorEntry | None
) -> tuple[MonitorSpec | None, MonitorEntry | None]:
    """Add the monitoring entry to a request's own spec. If the request itself reads the
    same attachment ``pre_steering`` the two cannot be told apart, so that request is not
    recorded (returns the entry None)."""
    if entry is None:
        return spec, None
    own = list(spec.entries) if spec is not None else []
    if any(e.key == entry.key and e.read_point == entry.read_point and e.tag == entry.tag for e in own):
        return spec, None
    return MonitorSpec([*own, entry]), entry


def _ours(record: EngineRecord, entry: MonitorEntry) -> bool:
    return (record.sae_id, record.layer, record.read_point, record.tag) == (
        entry.sae_id,
        entry.layer,
        entry.read_point,
        entry.tag,
    )


def take_records(
    ours: Callable[[EngineRecord], bool], *, finish: FinishEvent, tokens: Sequence[TokenEvent] = ()
) -> list[EngineRecord]:
    """Remove the records ``ours`` picks from a finished generation (from its finish event
    and its token events, so the request's own activations never show them) and return
    them in position order: /api/monitoring's entry, probes and sensing each take theirs."""
    taken = [r for r in finish.activations if ours(r)]
    finish.activations = [r for r in finish.activations if not ours(r)]
    for token in tokens:
        if token.activations:
            taken += [r for r in token.activations if ours(r)]
            token.activations = [r for r in token.activations if not ours(r)]
    return sorted(taken, key=lambda r: r.position)


def monitoring_take_records(
    *, entry: MonitorEntry, finish: FinishEvent, tokens: Sequence[TokenEvent] = ()
) -> list[EngineRecord]:
    """Remove the monitoring entry's records from a finished generation and return them."""
    return take_records(lambda r: _ours(r, entry), finish=finish, tokens=tokens)


class _RateCap:
    """At most ``rate`` events a second (per process), dropping the rest: a token bucket
    holding a second's worth, so a burst of up to ``rate`` goes out at once (a gap of
    1/rate between any two had dropped one of two generations 30 ms apart)."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self._tokens = self.rate
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


event_cap = _RateCap(EVENTS_PER_SECOND)


def monitoring_record(
    *, request_id: str, entry: MonitorEntry, records: Sequence[EngineRecord], owner: str = ANONYMOUS
) -> int:
    """Store one generation's records and publish its event; never raises into the
    request that produced them (a failure is logged)."""
    if not records:
        return 0
    try:
        now = timezone.now()
        rows = [
            ActivationRecord(
                timestamp=now,
                request_id=request_id,
                sae_id=r.sae_id,
                layer=r.layer,
                token_position=r.position,
                completion_token_index=r.token_index,
                activations=_pairs(r.features) if entry.features else _pairs(r.top_k),
                top_k=_pairs(r.top_k),
                owner=owner,
            )
            for r in records
        ]
        with transaction.atomic():
            ActivationRecord.objects.bulk_create(rows)
            _prune(monitoring_config().history_size, owner)
        if event_cap.allow():
            last = rows[-1]
            events.publish(
                "monitoring:activation",
                {
                    "timestamp": now.isoformat().replace("+00:00", "Z"),
                    "request_id": request_id,
                    "sae_id": last.sae_id,
                    "layer": last.layer,
                    "token_position": last.token_position,
                    "top_k": last.top_k,
                    "records": len(rows),
                    events.OWNER_FIELD: owner,
                },
            )
        return len(rows)
    except Exception:  # noqa: BLE001 - monitoring must never fail the generation it watched
        log.warning("monitoring_record_failed", request_id=request_id, exc_info=True)
        return 0


# --------------------------------------------------------------------------- captures
# Stored hidden-state captures (issue 15): the engine writes ``<id>.safetensors`` and
# ``<id>.json`` under CAPTURE_DIR; a row makes them fetchable by id until they expire.


def capture_register(*, request_id: str, result: Any, owner: str = ANONYMOUS) -> Any:
    """The ``Capture`` row of a stored artifact (``gpu_engine.api.protocol.CaptureResult``)."""
    from datetime import timedelta

    from django.conf import settings

    file_names(result.capture_id)  # refuses anything but 32 hex digits
    meta = result.meta or {}
    now = timezone.now()
    retention = int(settings.CAPTURE_RETENTION_S)
    return Capture.objects.create(
        id=result.capture_id,
        request_id=request_id,
        engine_request_id=str(meta.get("request_id", "")),
        model=str(meta.get("model", "")),
        backend=str(meta.get("backend", "")),
        layers=list(meta.get("layers", [])),
        positions=str(meta.get("positions", "")),
        rows=int(meta.get("rows", 0)),
        dtype=str(meta.get("dtype", "")),
        steering_hash=str(meta.get("steering_hash") or ""),
        nbytes=int(result.nbytes),
        created_at=now,
        owner=owner,
        expires_at=now + timedelta(seconds=retention) if retention else None,
    )


def capture_room() -> int | None:
    """Bytes left under CAPTURE_DIR_MAX_BYTES for stored captures (None: no quota). What
    has expired is pruned first, so a full store frees itself before it refuses."""
    from django.conf import settings
    from django.db.models import Sum

    quota = int(settings.CAPTURE_DIR_MAX_BYTES)
    if not quota:
        return None
    if Capture.objects.filter(expires_at__lte=timezone.now()).exists():
        capture_prune()
    used = Capture.objects.aggregate(total=Sum("nbytes"))["total"] or 0
    return max(0, quota - int(used))


def _capture_unlink(capture_id: str) -> None:
    root = capture_dir()
    for name in file_names(capture_id):
        (root / name).unlink(missing_ok=True)


@audited("capture.delete", lambda kw, r: ("capture", kw.get("capture_id", ""), ""))
def capture_delete(*, capture_id: str, scope: Scope = EVERYONE) -> None:
    row = capture_get(capture_id=capture_id, scope=scope)
    if row is None:
        raise CaptureNotFound(f"no capture {capture_id!r}", details={"capture_id": capture_id})
    row.delete()
    _capture_unlink(capture_id)


def capture_prune(*, now: Any = None) -> dict[str, int]:
    """Delete expired captures (row and files), and files under CAPTURE_DIR that no row
    names and that are older than the retention (an artifact whose response never got to
    register it)."""
    from datetime import timedelta

    from django.conf import settings

    now = now or timezone.now()
    expired = list(Capture.objects.filter(expires_at__lte=now).values_list("id", flat=True))
    for capture_id in expired:
        _capture_unlink(capture_id)
    Capture.objects.filter(id__in=expired).delete()
    orphans = 0
    retention = int(settings.CAPTURE_RETENTION_S)
    root = capture_dir()
    if retention and root.is_dir():
        cutoff = (now - timedelta(seconds=retention)).timestamp()
        known = set(Capture.objects.values_list("id", flat=True))
        for path in root.iterdir():
            stem = path.name.split(".", 1)[0]
            if path.is_file() and is_capture_id(stem) and stem not in known and path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                orphans += 1
    return {"deleted": len(expired), "orphan_files": orphans}
