"""Mutations of the steering experiments (docs/experiments.md).

``experiment_sweep_start`` and ``experiment_calibrate_start`` check everything a run
needs before anything is queued (the grid's size against EXPERIMENT_MAX_POINTS, every
variant resolved by the steering resolver against the engine's attachments: an unknown
SAE or feature, a mode the loaded backend cannot run, all refused naming the field) and
queue the run on the ``experiments`` queue once its row is committed
(``experiment_start``, which a fidelity run uses too).

A run has one runner at a time (``RUNS``, ``core.jobs.LongRuns``: a runner whose
heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead and the next one resumes
from the points stored); every write of a running run names its runner and is refused to
any other. Points are stored as each completes; a cancelled or failed run keeps them and
is marked ``partial``.
"""

from __future__ import annotations

from typing import Any

import structlog
from django.db import IntegrityError, transaction

from audit.services import audited
from core.auth import Principal
from core.events import OWNER_FIELD, publish
from core.jobs import LongRuns, Progress
from experiments.errors import ExperimentNotCancellable
from experiments.models import ExperimentPoint, ExperimentRun
from experiments.selectors import experiment_get
from features.services import storable
from registry.engines import addressing, saes_engine

log = structlog.get_logger(__name__)

QUEUE = "experiments"
TASK = "experiments.tasks.experiment_run_task"
PROGRESS_EVERY_S = 0.5  # experiment:progress while a run runs, at most this often

# the ExperimentPoint fields a kind may store
POINT_FIELDS = frozenset(
    f.name for f in ExperimentPoint._meta.get_fields() if f.concrete and f.name not in ("id", "run", "created_at")
)


def _ending(run: ExperimentRun, status: str) -> list[str]:
    """A run that ends without completing keeps the points it stored: ``partial``."""
    run.partial = status != ExperimentRun.Status.COMPLETED and run.points.exists()
    return ["partial"]


def _ended(run: ExperimentRun) -> None:
    experiment_progress(run=run, force=True)
    if run.status == ExperimentRun.Status.COMPLETED:
        log.info("experiment_completed", run_id=run.id, kind=run.kind, done=run.done)
        publish("experiment:complete", {"run_id": run.id, "kind": run.kind, OWNER_FIELD: run.owner})
    elif run.status == ExperimentRun.Status.FAILED:
        error = run.error or {}
        log.warning("experiment_failed", run_id=run.id, kind=run.kind, **error)
        publish(
            "experiment:error",
            {
                "run_id": run.id,
                "kind": run.kind,
                "code": error.get("code"),
                "message": error.get("message"),
                OWNER_FIELD: run.owner,
            },
        )


RUNS = LongRuns(
    ExperimentRun,
    what="experiment",
    task=TASK,
    queue=QUEUE,
    failed_code="EXPERIMENT_RUNNER_FAILED",
    label="Experiment",
    ending=_ending,
    ended=_ended,
)


# --------------------------------------------------------------------------- starting


def experiment_start(
    *,
    kind: str,
    spec: dict[str, Any],
    principal: Principal,
    total: int = 0,
    sae_id: str = "",
    layer: int | None = None,
) -> ExperimentRun:
    """Queue a run whose ``spec`` its kind has checked (``queued``; the ``experiments``
    queue runs it); ``total``: the points it will have when complete, if known."""
    if kind not in ExperimentRun.Kind.values:
        raise ValueError(f"unknown experiment kind {kind!r}")
    with transaction.atomic():
        run = ExperimentRun.objects.create(
            kind=kind, owner=principal.owner, spec=spec, total=int(total), sae_id=sae_id or "", layer=layer
        )
        RUNS.enqueue(run.id)
    log.info("experiment_queued", run_id=run.id, kind=kind, total=total)
    experiment_progress(run=run, force=True)
    return run


def run_target(kwargs: dict[str, Any], run: ExperimentRun | None) -> tuple[str, Any, str]:
    """An audit entry's target: the run (its kind as the name), or the run id asked for."""
    if run is not None:
        return ("experiment_run", run.id, run.kind)
    return ("experiment_run", kwargs.get("run_id", ""), "")


def spec_params(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What an audit entry keeps of a start's body: what it acts on, not its prompts."""
    data = kwargs.get("data") or {}
    keep = ("sae_id", "layer", "save_profile", "target_kl", "strengths", "corpus", "file_id")
    out = {k: data[k] for k in keep if k in data}
    if "token_budget" in data:  # a key naming "token" is never kept
        out["budget"] = data["token_budget"]
    variants = data.get("variants") or ([data["variant"]] if isinstance(data.get("variant"), dict) else [])
    if variants:
        out["variants"] = [
            {k: v.get(k) for k in ("sae_id", "index", "layer") if k in v} for v in variants if isinstance(v, dict)
        ]
    return out


@audited("experiment.sweep", run_target, params=spec_params)
def experiment_sweep_start(*, principal: Principal, data: dict[str, Any]) -> ExperimentRun:
    """Check a sweep (``experiments.sweep.sweep_check``: everything refused before
    anything runs) and queue it."""
    from core.runtime import runtime
    from experiments.sweep import sweep_check

    variants = data.get("variants") or []
    sae_ids = [str(v.get("sae_id") or "") for v in variants if isinstance(v, dict)]
    with addressing(saes_engine(sae_ids)):  # the engine of the variants' SAEs (registry.engines)
        status = runtime().engine.status()
    plan = sweep_check(data=data, status=status)
    return experiment_start(kind=ExperimentRun.Kind.SWEEP, spec=plan.spec, principal=principal, total=plan.total)


@audited("experiment.calibrate", run_target, params=spec_params)
def experiment_calibrate_start(*, principal: Principal, data: dict[str, Any]) -> ExperimentRun:
    """Check a calibration (``experiments.calibration.calibration_check``) and queue it;
    saving into a profile needs an admin key (profiles are shared documents)."""
    from core.runtime import runtime
    from experiments.calibration import calibration_check

    variant = data.get("variant")
    sae_id = str(variant.get("sae_id") or "") if isinstance(variant, dict) else ""
    with addressing(saes_engine([sae_id])):  # the engine of the variant's SAE's model
        status = runtime().engine.status()
    plan = calibration_check(data=data, status=status, principal=principal)
    return experiment_start(
        kind=ExperimentRun.Kind.CALIBRATION,
        spec=plan.spec,
        principal=principal,
        total=plan.total,
        sae_id=plan.sae_id,
        layer=plan.layer,
    )


@audited("experiment.cancel", run_target)
def experiment_cancel(*, run_id: str, principal: Principal) -> ExperimentRun:
    """``cancelling``: the runner cancels its jobs at the engine and ends the run
    ``cancelled`` (the points stored stay, ``partial``); a run no live runner holds ends
    ``cancelled`` at once. 409 once it ended; 404 for another owner's."""
    experiment_get(run_id, principal)
    return RUNS.cancel(run_id, not_cancellable=ExperimentNotCancellable)


# --------------------------------------------------------------------------- a running run


def experiment_take_over(*, run_id: str, runner: str, force: bool = False) -> tuple[str, ExperimentRun | None]:
    return RUNS.take_over(run_id=run_id, runner=runner, force=force)


def experiment_heartbeat(*, run_id: str, runner: str) -> str | None:
    """The run's status, or None when this runner no longer holds it."""
    return RUNS.heartbeat(run_id=run_id, runner=runner)


def experiment_points_store(*, run_id: str, runner: str, points: list[dict[str, Any]], count_done: bool = True) -> int:
    """Store complete points of the run this runner holds (one already stored under its
    ordinal is kept); with ``count_done``, ``done`` becomes the number stored. How many
    the run holds; -1 when this runner no longer holds it."""
    rows = []
    for point in points:
        unknown = set(point) - POINT_FIELDS
        if unknown:
            raise ValueError(f"not ExperimentPoint fields: {sorted(unknown)}")
        # a generated text may hold NUL (a byte-level vocabulary has a token for it), which
        # PostgreSQL's text and jsonb cannot: shown as U+2400, as dashboards store tokens
        rows.append(ExperimentPoint(run_id=run_id, **{k: storable(v) for k, v in point.items()}))
    with transaction.atomic():
        run = ExperimentRun.objects.select_for_update().filter(id=run_id, runner=runner).first()
        if run is None:
            return -1
        try:
            ExperimentPoint.objects.bulk_create(rows, ignore_conflicts=True)
        except IntegrityError:  # a backend without ignore_conflicts: one at a time
            for row in rows:
                ExperimentPoint.objects.get_or_create(run_id=run_id, ordinal=row.ordinal, defaults=_fields(row))
        count = ExperimentPoint.objects.filter(run_id=run_id).count()
        RUNS.touch(run_id=run_id, runner=runner, **({"done": count} if count_done else {}))
    experiment_progress(run_id=run_id)
    return count


def _fields(row: ExperimentPoint) -> dict[str, Any]:
    return {name: getattr(row, name) for name in POINT_FIELDS if name != "ordinal"}


def experiment_advance(*, run_id: str, runner: str, done: int | None = None, total: int | None = None) -> bool:
    """Record the run's progress; False when this runner no longer holds it."""
    return RUNS.advance(
        run_id=run_id, runner=runner, progress=experiment_progress, force=total is not None, done=done, total=total
    )


def experiment_result_merge(*, run_id: str, runner: str, fields: dict[str, Any]) -> bool:
    """Merge ``fields`` into the run's ``result``; False when this runner no longer holds it."""
    with transaction.atomic():
        run = ExperimentRun.objects.select_for_update().filter(id=run_id, runner=runner).first()
        if run is None:
            return False
        run.result = {**(run.result or {}), **fields}
        run.save(update_fields=["result"])
    return True


def experiment_complete(*, run_id: str, runner: str, result: dict[str, Any]) -> str:
    """End the run ``completed`` with ``result`` merged into its own (a cancel recorded
    first wins: ``cancelled``, partial); its status after, or ``lost``."""
    run = ExperimentRun.objects.filter(id=run_id, runner=runner).only("result").first()
    merged = {**((run.result or {}) if run is not None else {}), **result}
    ended = RUNS.finish(run_id=run_id, runner=runner, status=ExperimentRun.Status.COMPLETED, result=merged)
    return "lost" if ended is None else ended.status


def experiment_fail(*, run_id: str, runner: str, code: str, message: str) -> str:
    """End the run ``failed`` with ``error`` {code, message}; the points stored stay
    (``partial``). Its status after, or ``lost``."""
    ended = RUNS.finish(
        run_id=run_id, runner=runner, status=ExperimentRun.Status.FAILED, error={"code": code, "message": message}
    )
    return "lost" if ended is None else ended.status


def experiment_cancelled(*, run_id: str, runner: str) -> str:
    """The runner saw the cancel and stopped: ``cancelled`` (partial when points stay)."""
    ended = RUNS.finish(run_id=run_id, runner=runner, status=ExperimentRun.Status.CANCELLED)
    return "lost" if ended is None else ended.status


# ``experiment:progress`` over /ws/events (ids, kind, status and counts, never prompt
# text), to the run's owner and admin sockets only; while it runs at most every
# PROGRESS_EVERY_S per run: ``experiment_progress(run=run)`` or ``(run_id=...)``, ``force``
# to send it now
experiment_progress = Progress(
    ExperimentRun, "experiment:progress", ("kind", "status", "done", "total", "partial"), every_s=PROGRESS_EVERY_S
)


# --------------------------------------------------------------------------- every run


def experiments_sweep() -> dict[str, int]:
    """The experiments sweeper's pass (every BATCH_SWEEP_INTERVAL_S in each process that
    runs experiments): ``core.jobs.LongRuns.sweep``."""
    return RUNS.sweep()


def experiments_resume(*, force: bool) -> int:
    """Queue a runner for every run not ended (a start-up): ``LongRuns.resume``."""
    return RUNS.resume(force=force)
