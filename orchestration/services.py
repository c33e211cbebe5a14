"""Engine orchestration: the only places that change what the engine holds — load,
unload, attach, detach — and what each means for the rows, leases and live steering.
Each call records the outcome on the rows (status, attachments) so the database always
says what is resident. Views, admin actions, commands and tasks all call these.

This module loads and unloads; a load's checks and engine job are
``orchestration.load_checks``, the SAEs' attach and detach ``orchestration.attachments``
(both re-exported here)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import structlog
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import audited, error_code
from core import events, jobs, metrics
from core.engine_client import resolve_device_and_dtype
from core.engines import (
    DEFAULT_ENGINE,
    current_engine,
    engine_for_model,
    engine_names,
    several_engines,
    using_engine,
)
from core.errors import (
    ModelBusy,
    ModelLoadFailed,
    ModelNotLoaded,
    from_engine_error,
)
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from leases.services import lease_check_change, lease_end_for_model
from orchestration.attachments import (  # noqa: F401 - re-exported: the attachments' mutations
    _check_sae_ready,
    attachment_forget,
    circuit_activate,
    sae_attach,
    sae_attach_set,
    sae_check_compatibility,
    sae_detach,
)
from orchestration.errors import LoadInProgress
from orchestration.load_checks import (  # noqa: F401 - re-exported: a load's checks and job
    _NO_ANSWER,
    FULL_PRECISION,
    _check_backend,
    _check_engine_accepts,
    _check_loadable,
    _check_quantization,
    load_job,
)
from orchestration.memory_fit import check_model_fits
from registry.engines import addressing_held
from registry.errors import (
    ModelAlreadyLoaded,
    ModelInvalid,
    ModelLocked,
)
from registry.job_lifecycle import job_create, job_finish, job_progress, job_start
from registry.models import SAE, Attachment, Job, Model
from registry.selectors import active_job, model_loaded
from registry.services import model_set_status
from steering.forget import live_forget

log = structlog.get_logger(__name__)


def _engine():
    return runtime().engine


@contextmanager
def model_engine(model: Model):
    """Address ``model``'s engine (``core.engines``) for what this wraps: the engine that
    holds or is loading it (its row says), else the one ENGINE_MODELS gives it
    (``model_not_routable`` when none may). With one engine nothing changes."""
    with addressing_held(model.name, model.engine) as name:
        yield name


# Claims serialise here within a process (SQLite has no row locks: embedded mode is one
# process) and through row locks across processes (PostgreSQL, distributed mode).
_CLAIM_LOCK = threading.Lock()

# Statuses a load may start from; LOADED reloads a row the engine does not hold.
_LOADABLE = (Model.Status.READY, Model.Status.ERROR, Model.Status.LOADED)


def _lock_model_rows() -> None:
    """Lock every model row for the transaction: a claim reads the other rows (is any
    load or unload running?), and a lock on its own row alone would let two claims for
    two different models both pass. The table holds a handful of rows."""
    list(Model.objects.select_for_update().order_by("pk").values_list("pk", flat=True))


def _model_in_transition(*, exclude_pk: int) -> Model | None:
    moving = Model.objects.filter(status__in=(Model.Status.LOADING, Model.Status.UNLOADING)).exclude(pk=exclude_pk)
    if several_engines():  # engines load and unload independently: the addressed one's
        moving = moving.filter(engine=current_engine())
    return moving.first()


def _engine_holds(name: str) -> bool:
    try:
        return _engine().status().model_id == name
    except EngineError:  # no engine to ask (distributed, engine down): it holds nothing
        return False


def _claim_load(model: Model) -> str:
    """Mark ``model`` as loading unless a load or an unload is under way anywhere; the
    status it had before (a refused load puts it back). One conditional change of the
    rows, so of two processes starting the same load at once exactly one goes ahead."""
    with _CLAIM_LOCK, transaction.atomic():
        _lock_model_rows()
        row = Model.objects.get(pk=model.pk)
        if row.status == Model.Status.LOADING:
            raise LoadInProgress(
                f"Model {row.name!r} is being loaded; retry shortly",
                details={"model_id": row.id, "loading": row.name},
                retry_after=settings.RETRY_AFTER_LOAD_S,
            )
        if row.status == Model.Status.UNLOADING:
            raise ModelBusy(
                f"Model {row.name!r} is being unloaded; retry shortly",
                details={"model_id": row.id, "state": "unloading"},
                retry_after=settings.RETRY_AFTER_UNLOAD_S,
            )
        other = _model_in_transition(exclude_pk=row.pk)
        if other is not None:
            raise ModelBusy(
                f"Model {other.name!r} is {other.status}; retry shortly",
                details={"model_id": row.id, other.status: other.name},
                retry_after=settings.RETRY_AFTER_LOAD_S,
            )
        if row.status == Model.Status.LOADED and _engine_holds(row.name):
            raise ModelAlreadyLoaded(f"Model {row.name!r} is already loaded", details={"model_id": row.id})
        if row.status not in _LOADABLE or not row.local_path:
            raise ModelInvalid(
                f"Model {row.name!r} has no files yet (status {row.status})",
                details={"model_id": row.id, "status": row.status},
            )
        Model.objects.filter(pk=row.pk).update(
            status=Model.Status.LOADING, error_message="", engine=current_engine(), updated_at=timezone.now()
        )
        return row.status


def _unclaim_load(model: Model, previous: str) -> None:
    engine = {} if previous == Model.Status.LOADED else {"engine": ""}
    Model.objects.filter(pk=model.pk, status=Model.Status.LOADING).update(
        status=previous, updated_at=timezone.now(), **engine
    )


def _model(kwargs: dict, _result: object) -> tuple[str, object, str]:
    model = kwargs.get("model")
    return ("model", getattr(model, "pk", ""), getattr(model, "name", ""))


def _lease(kwargs: dict) -> dict:
    return {"lease": bool(kwargs.get("lease_id"))}  # whether one was shown, never the id


# a job's run of a load finishes its request's entry (job_finish); a direct load (/v1's
# on-demand load, start-up, manage.py) is its own entry
@audited("model.load", _model, params=lambda kw: {"on_demand": True}, skip=lambda kw: kw.get("job") is not None)
def model_load(*, model: Model, job: Job | None = None) -> Model:
    """Load ``model`` into its engine (replacing the one that engine holds) and record it.

    Synchronous: the API runs it in a background job (``model_load_enqueue``), /v1 on its
    own thread for an on-demand load. Progress goes on the job row and out as
    ``model:load:progress`` events. Single-flight across processes: the row is claimed
    first (``_claim_load``); a caller that loses the claim gets ``LoadInProgress`` (or
    model_busy while something else moves) and no job row of its own.
    """
    with ExitStack() as stack:
        try:
            stack.enter_context(model_engine(model))
        except Exception as exc:  # model_not_routable: the job ends with it
            if job is not None and job.status not in Job.FINISHED:
                job_finish(
                    job=job, status=Job.Status.FAILED, error=getattr(exc, "message", str(exc)), code=error_code(exc)
                )
            raise
        return _model_load(model=model, job=job)


def _model_load(*, model: Model, job: Job | None) -> Model:
    try:
        model_jobs_reap()  # a load whose worker died must not block this one for ever
        model.refresh_from_db()
        resident = _check_loadable(model)
        previous = _claim_load(model)
    except Exception as exc:
        if job is not None and job.status not in Job.FINISHED:
            job_finish(job=job, status=Job.Status.FAILED, error=getattr(exc, "message", str(exc)), code=error_code(exc))
        metrics.record_load(operation="load", outcome="refused")
        raise
    job = job or job_create(kind=Job.Kind.MODEL_LOAD, target=model.name, model=model)
    try:
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
        job_start(job=job, stage="preparing")
        job_progress(job=job, progress=0, stage="preparing")  # listeners hear it start
        job_progress(job=job, progress=5, stage="checking memory")
        check_model_fits(model, device, dtype, resident=model_loaded(other_than=model))
    except Exception as exc:
        _unclaim_load(model, previous)
        if job.status not in Job.FINISHED:
            job_finish(job=job, status=Job.Status.FAILED, error=getattr(exc, "message", str(exc)), code=error_code(exc))
        metrics.record_load(operation="load", outcome="refused")
        raise
    model.refresh_from_db()
    job_progress(job=job, progress=10, stage="loading weights")
    try:
        _engine().load_model(
            load_job(model, device=device, dtype=dtype), timeout_s=float(settings.GRACEFUL_UNLOAD_TIMEOUT)
        )
    except EngineError as exc:
        error = from_engine_error(exc)
        if exc.code == "engine_busy":
            # the resident model's requests outlasted the grace period: nothing changed
            _unclaim_load(model, previous)
            if isinstance(error, ModelBusy) and error.retry_after is None:
                error.retry_after = settings.RETRY_AFTER_LOAD_S
        else:
            model_set_status(model=model, status=Model.Status.ERROR, error=error.message)
            _reconcile_after_failed_load(resident)
        job_finish(job=job, status=Job.Status.FAILED, error=error.message, code=error.code)
        metrics.record_load(operation="load", outcome="failed")
        raise error from exc
    except BaseException as exc:
        model_set_status(model=model, status=Model.Status.ERROR, error=str(exc)[:500])
        _reconcile_after_failed_load(resident)
        job_finish(job=job, status=Job.Status.FAILED, error=type(exc).__name__, code="INTERNAL_ERROR")
        metrics.record_load(operation="load", outcome="failed")
        raise
    with transaction.atomic():
        if resident is not None:
            _forget_model_state(resident, reason="model_replaced")
        # rows an engine restart left behind for this model: the new load holds none
        _forget_attachments(model, reason="model_reloaded")
        model_set_status(model=model, status=Model.Status.LOADED, device=device, dtype=dtype)
    if resident is not None:
        events.publish("model:unload:complete", {"model_id": resident.id, "reason": "replaced"})
    job_progress(job=job, progress=95, stage="recorded")
    job_finish(job=job, status=Job.Status.SUCCEEDED)
    metrics.record_load(operation="load", outcome="succeeded")
    log.info("model_loaded", model_id=model.id, device=device, dtype=dtype)
    return model


# A Celery worker running a load or unload touches its job row this often; a running job
# untouched for JOB_STALE_AFTER_S belongs to a worker that died (tasks._Heartbeat).
JOB_HEARTBEAT_S = 5.0
JOB_STALE_AFTER_S = 30.0


def model_jobs_reap() -> int:
    """End the load and unload jobs whose worker died (distributed mode: ``running`` and
    not touched for JOB_STALE_AFTER_S), and make the model rows say what the engine holds:
    the model it holds ``loaded`` (a load that got as far as the engine), a model it does
    not hold back to ``ready`` with its attachments, steering and lease gone; with no engine
    answering, a load that never recorded is undone and an unload's model stays recorded
    (a restarted engine restores it). Left for later while the engine still reports a load
    or unload under way. Cheap when there is nothing to reap; called where a stuck job
    would otherwise be waited on (loads, unloads, waits for a load, readiness)."""
    if settings.EMBEDDED:
        return 0  # the job ran in this process; a restart reconciles (startup_reconcile)
    cutoff = timezone.now() - timedelta(seconds=JOB_STALE_AFTER_S)
    stale = Job.objects.filter(
        kind__in=(Job.Kind.MODEL_LOAD, Job.Kind.MODEL_UNLOAD), status=Job.Status.RUNNING, updated_at__lt=cutoff
    )
    if not stale.exists():
        return 0
    if not several_engines():
        return _reap(stale, Model.objects.all())
    reaped = 0
    for name in engine_names():
        # each engine's jobs and rows against that engine's own status
        on_engine = Q(engine=name) | Q(engine="") if name == DEFAULT_ENGINE else Q(engine=name)
        with using_engine(name):
            reaped += _reap(stale.filter(model__in=Model.objects.filter(on_engine)), Model.objects.filter(on_engine))
    return reaped


def _reap(stale, models) -> int:
    """``model_jobs_reap`` for the addressed engine: ``stale`` jobs, ``models`` its rows."""
    if not stale.exists():
        return 0
    try:
        status = _engine().status()
    except EngineError:
        status = None
    if status is not None and status.draining:
        return 0  # the engine is still carrying the operation out: not stuck yet
    held = status.model_id if status is not None else None
    reaped = 0
    with _CLAIM_LOCK, transaction.atomic():
        _lock_model_rows()
        for job in list(stale.select_for_update()):
            job_finish(
                job=job,
                status=Job.Status.FAILED,
                error=f"the worker running it stopped (no heartbeat for {JOB_STALE_AFTER_S:g}s)",
            )
            reaped += 1
        for row in models.filter(status__in=(Model.Status.LOADING, Model.Status.UNLOADING, Model.Status.LOADED)):
            if status is not None and row.name == held:
                if row.status != Model.Status.LOADED:
                    model_set_status(
                        model=row, status=Model.Status.LOADED, device=status.device or "", dtype=status.dtype or ""
                    )
                    transaction.on_commit(
                        lambda r=row: events.publish("model:load:complete", {"model_id": r.id, "reason": "reconciled"})
                    )
            elif status is None and row.status != Model.Status.LOADING:
                Model.objects.filter(pk=row.pk).update(status=Model.Status.LOADED)
            elif status is None:
                Model.objects.filter(pk=row.pk).update(status=Model.Status.READY, engine="")
            else:
                _forget_model_state(row, reason="unload")
                transaction.on_commit(
                    lambda r=row: events.publish("model:unload:complete", {"model_id": r.id, "reason": "reconciled"})
                )
    log.warning("model_jobs_reaped", jobs=reaped, engine_holds=held)
    return reaped


def model_load_wait(*, name: str, timeout_s: float) -> Model:
    """Wait (bounded) for a load another process claimed to end; the row then. A load
    that failed raises its error here too, so every waiter learns it."""
    deadline = time.monotonic() + timeout_s
    next_reap = time.monotonic() + JOB_HEARTBEAT_S
    while True:
        row = Model.objects.get(name=name)
        if row.status != Model.Status.LOADING:
            break
        if time.monotonic() > next_reap:  # a load whose worker died never ends on its own
            model_jobs_reap()
            next_reap = time.monotonic() + JOB_HEARTBEAT_S
            continue
        if time.monotonic() > deadline:
            raise ModelBusy(
                f"Model {name!r} is still loading; retry shortly",
                details={"model_id": row.id},
                retry_after=settings.RETRY_AFTER_LOAD_S,
            )
        time.sleep(0.1)
    if row.status == Model.Status.ERROR:
        raise ModelLoadFailed(f"Loading model {name!r} failed: {row.error_message}", details={"model_id": row.id})
    return row


def _forget_attachments(model: Model, *, reason: str) -> None:
    """The engine no longer holds ``model``'s attachments: their live steering, the
    documents steering through them and their rows go, and each one's ``sae:detached``
    is published once the transaction commits. Inside a transaction."""
    attachments = list(Attachment.objects.filter(model=model))
    live_forget(attachments=attachments)
    Attachment.objects.filter(pk__in=[a.pk for a in attachments]).delete()
    SAE.objects.filter(status=SAE.Status.ATTACHED).exclude(attachments__isnull=False).update(
        status=SAE.Status.READY, updated_at=timezone.now()
    )
    for a in attachments:
        transaction.on_commit(
            lambda s=a.sae_id, lay=a.layer: events.publish(
                "sae:detached", {"sae_id": s, "layer": lay, "reason": reason}
            )
        )


def _forget_model_state(model: Model, *, reason: str) -> None:
    """``model`` is no longer resident: its attachments, its lease and its row's residency
    go. Inside a transaction."""
    _forget_attachments(model, reason=reason)
    lease_end_for_model(model_id=model.pk)  # a lease ends with its model's residency
    Model.objects.filter(pk=model.pk).update(
        status=Model.Status.READY,
        locked=False,
        locked_by_operator=False,
        device="",
        dtype="",
        engine="",
        updated_at=timezone.now(),
    )


def _reconcile_after_failed_load(resident: Model | None) -> None:
    """A failed load may have dropped the resident model (the engine frees it before
    loading the next). When the engine answers that it no longer holds it, the rows say so
    too; when no engine answers, the record stands (a restarted engine restores it)."""
    if resident is None:
        return
    try:
        held = _engine().status().model_id
    except EngineError:
        return
    if held == resident.name:
        return
    with transaction.atomic():
        _forget_model_state(resident, reason="load_failed")
    events.publish("model:unload:complete", {"model_id": resident.id, "reason": "load_failed"})
    log.warning("resident_model_lost_in_failed_load", model_id=resident.id, engine_holds=held)


def model_unload(*, model: Model, job: Job | None = None) -> Model:
    """Unload the resident model: new /v1 requests are refused (the row says
    ``unloading``, then the engine drains: 503 model_busy), the running ones get up to
    GRACEFUL_UNLOAD_TIMEOUT to finish, then they are stopped and the weights go.

    The engine does the waiting: it counts every request running on it, whichever web
    process sent it, so the grace period holds wherever this runs (a web worker, a
    Celery worker, a management command). On the engine that holds it."""
    model.refresh_from_db()
    with model_engine(model):
        return _model_unload(model=model, job=job)


def _model_unload(*, model: Model, job: Job | None) -> Model:
    if model.status != Model.Status.LOADED:
        raise ModelNotLoaded(
            f"Model {model.name!r} is not loaded", details={"model_id": model.id, "status": model.status}
        )
    if model.locked:
        raise ModelLocked(f"Model {model.name!r} is locked; unlock it first", details={"model_id": model.id})
    with _CLAIM_LOCK, transaction.atomic():
        _lock_model_rows()
        other = _model_in_transition(exclude_pk=model.pk)
        claimed = other is None and Model.objects.filter(pk=model.pk, status=Model.Status.LOADED, locked=False).update(
            status=Model.Status.UNLOADING, updated_at=timezone.now()
        )
    if other is not None:
        raise ModelBusy(
            f"Model {other.name!r} is {other.status}; retry shortly",
            details={"model_id": model.id, other.status: other.name},
            retry_after=settings.RETRY_AFTER_LOAD_S,
        )
    if not claimed:
        raise ModelBusy(
            f"Model {model.name!r} changed state; retry",
            details={"model_id": model.id},
            retry_after=settings.RETRY_AFTER_UNLOAD_S,
        )
    if job is not None:
        job_start(job=job, stage="waiting for running requests")
    try:
        _engine().unload_model(timeout_s=float(settings.GRACEFUL_UNLOAD_TIMEOUT))
    except EngineError as exc:
        Model.objects.filter(pk=model.pk, status=Model.Status.UNLOADING).update(
            status=Model.Status.LOADED, updated_at=timezone.now()
        )
        error = from_engine_error(exc)
        if isinstance(error, ModelBusy) and error.retry_after is None:
            error.retry_after = settings.RETRY_AFTER_UNLOAD_S
        if job is not None:
            job_finish(job=job, status=Job.Status.FAILED, error=error.message, code=error.code)
        metrics.record_load(operation="unload", outcome="failed")
        raise error from exc
    with transaction.atomic():
        _forget_model_state(model, reason="unload")
    model.refresh_from_db()
    events.publish("model:unload:complete", {"model_id": model.id, "reason": "unload"})
    if job is not None:
        job_finish(job=job, status=Job.Status.SUCCEEDED)
    metrics.record_load(operation="unload", outcome="succeeded")
    log.info("model_unloaded", model_id=model.id)
    return model


@audited("model.load", _model, params=_lease, job=lambda job: job)
def model_load_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    model_jobs_reap()  # committed on its own: a refusal below must not undo it
    with model_engine(model):  # model_not_routable before any job row
        return _model_load_enqueue(model=model, lease_id=lease_id)


@transaction.atomic
def _model_load_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    """Start a background load (the API's route): the job row now, the load after commit.

    Idempotent while a load of the same model is queued or running (its job is returned);
    a load of another model queues behind it (MAX_LOAD_WORKERS at a time).
    """
    model = Model.objects.select_for_update().get(pk=model.pk)
    existing = active_job(model=model, kinds=(Job.Kind.MODEL_LOAD,))
    if existing is not None:
        return existing
    if model_loaded(other_than=model) is not None:
        lease_check_change(operation="load", target_model=model, lease_id=lease_id)
    if model.status == Model.Status.LOADED:
        raise ModelAlreadyLoaded(f"Model {model.name!r} is already loaded", details={"model_id": model.id})
    if model.status == Model.Status.UNLOADING:
        raise ModelBusy(
            f"Model {model.name!r} is being unloaded",
            details={"model_id": model.id},
            retry_after=settings.RETRY_AFTER_UNLOAD_S,
        )
    resident = _check_loadable(model)
    _check_fits_early(model, resident)
    job = job_create(kind=Job.Kind.MODEL_LOAD, target=model.name, model=model)
    jobs.enqueue("orchestration.tasks.model_load_task", job.id, queue="loads")
    return job


def _check_fits_early(model: Model, resident: Model | None) -> None:
    """The memory-fit refusal at the request, before a job is queued (the load's job
    decides again with what is free when it runs); skipped while no engine can say where
    it would load (distributed mode, engine down: the job decides)."""
    try:
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
    except EngineError:
        return
    check_model_fits(model, device, dtype, resident=resident)


@audited("model.unload", _model, params=_lease, job=lambda job: job)
def model_unload_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    model_jobs_reap()  # committed on its own: a refusal below must not undo it
    with model_engine(model):
        return _model_unload_enqueue(model=model, lease_id=lease_id)


@transaction.atomic
def _model_unload_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    model = Model.objects.select_for_update().get(pk=model.pk)
    existing = active_job(model=model, kinds=(Job.Kind.MODEL_UNLOAD,))
    if existing is not None:
        return existing
    if model.status == Model.Status.LOADED:
        lease_check_change(operation="unload", target_model=model, lease_id=lease_id)
    if active_job(model=model, kinds=(Job.Kind.MODEL_LOAD,)) is not None or model.status == Model.Status.LOADING:
        raise ModelBusy(
            f"Model {model.name!r} is being loaded; retry when it is",
            details={"model_id": model.id},
            retry_after=settings.RETRY_AFTER_LOAD_S,
        )
    pending = next(
        (
            job
            for job in Job.objects.filter(kind=Job.Kind.MODEL_LOAD, status__in=Job.ACTIVE).exclude(model=model)
            if not several_engines() or engine_for_model(job.target) == current_engine()
        ),
        None,
    )
    if pending is not None:
        # that load replaces this model anyway; an unload queued beside it would only fail
        raise ModelBusy(
            f"A load of {pending.target!r} is pending and will replace {model.name!r}; retry when it has finished",
            details={"model_id": model.id, "loading": pending.target},
            retry_after=settings.RETRY_AFTER_LOAD_S,
        )
    if model.status != Model.Status.LOADED:
        raise ModelNotLoaded(
            f"Model {model.name!r} is not loaded", details={"model_id": model.id, "status": model.status}
        )
    if model.locked:
        raise ModelLocked(
            f"Model {model.name!r} is locked; unlock it (or detach its SAEs) first", details={"model_id": model.id}
        )
    job = job_create(kind=Job.Kind.MODEL_UNLOAD, target=model.name, model=model)
    jobs.enqueue("orchestration.tasks.model_unload_task", job.id, queue="loads")
    return job
