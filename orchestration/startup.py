"""What a start-up asks of the engine: the registry reconciled and (embedded mode) what it
records as resident restored, whatever server runs the application; AUTO_LOAD_MODEL
loaded in the background and AUTO_ATTACH_SAES attached once that load has finished."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import structlog
from django.conf import settings
from django.db.models import Q

from core import jobs
from core.errors import ValidationFailed
from core.runtime import runtime
from orchestration import services
from orchestration.load_checks import check_engine_device, check_speculative_model
from orchestration.restore import restore_recorded_state
from leases.errors import ModelLeased
from leases.selectors import lease_live
from registry.errors import ModelLocked, ModelNotFound, SAENotFound
from registry.maintenance import model_by_name_or_id, startup_reconcile
from registry.models import SAE, Job, Model

log = structlog.get_logger(__name__)

_start_lock = threading.Lock()
_started = False


class _RestoreAttempts:
    """The embedded restore's attempt count, in a file of MILLM_DATA_DIR: it must survive
    the crash of the process that restores (run_engine keeps its count in Redis)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def begin(self) -> int:
        try:
            count = int(self.path.read_text().strip() or 0) + 1
        except (OSError, ValueError):
            count = 1
        self.path.write_text(str(count))
        return count

    def end(self) -> None:
        self.path.unlink(missing_ok=True)


def application_start(*, auto_load_model: bool = True) -> None:
    """Once per process that serves the application, before it serves (the ASGI module
    calls it on import, so it runs under ``manage.py serve``, ``daphne`` or any other
    ASGI server alike):

    - rows a previous process left mid-way are reconciled (``startup_reconcile``);
    - in embedded mode, the model and SAE attachments the registry records are loaded
      into this process's engine again, as run_engine does in distributed mode, so the
      rows and the engine agree before the first request. What cannot be restored is
      recorded on the rows (status ``error`` with the reason; attachments dropped);
    - in embedded mode, MILLM_ENGINE_DEVICE=cuda:N must name a card of this host
      (``check_engine_device``); anything else raises;
    - SPECULATIVE_MODEL must name a draft the engine can read (a registered model's name
      or repository id, self:layers=N, a checkpoint directory); anything else raises;
    - AUTO_LOAD_MODEL starts loading (unless ``auto_load_model`` is False: ``serve
      --no-auto-load``); a name that is not registered raises.
    """
    global _started
    with _start_lock:
        if _started:
            return
        _started = True

    startup_reconcile()
    check_speculative_model()  # a draft that names nothing refuses the start, not each load
    if settings.EMBEDDED:
        check_engine_device()  # a card that does not exist refuses the start, not each load
        attempts = _RestoreAttempts(Path(settings.DATA_DIR) / "restore_attempts")
        restore_recorded_state(engine=runtime().engine, begin_restore=attempts.begin, end_restore=attempts.end)
    if settings.AUTO_LOAD_MODEL and auto_load_model:
        auto_load()


def auto_load() -> Job | None:
    """Start loading AUTO_LOAD_MODEL in the background (readiness waits for it).

    The configured model wins over the one a restart restored (the registry's record of
    the last run): the restored model is swapped out, its attachments and steering with
    it, as any load of another model does. Unless it is held: a locked resident model, or
    one under a live lease, stays, AUTO_LOAD_MODEL and AUTO_ATTACH_SAES are not applied,
    the log says so, and ``/api/health/ready`` says why (``auto_load_state``)."""
    name = settings.AUTO_LOAD_MODEL
    if not name:
        return None
    model = model_by_name_or_id(name)
    targets = auto_attach_targets()  # a typo fails the start-up, not a background task
    job = None
    if model.status != Model.Status.LOADED:
        try:
            job = services.model_load_enqueue(model=model)
        except (ModelLocked, ModelLeased) as exc:
            log.warning("auto_load_skipped", model=model.name, reason=exc.message)
            return None
        log.info("auto_load_started", model=model.name, job_id=job.id)
    if targets:
        jobs.enqueue("orchestration.tasks.auto_attach_task", job.id if job else None, queue="maintenance")
    return job


def auto_load_state(resident: str | None) -> dict | None:
    """For ``/api/health/ready``: AUTO_LOAD_MODEL, what is resident, whether the setting
    holds and, when it does not, why (a locked or leased resident model, a load under way,
    or a model loaded since start-up). None without AUTO_LOAD_MODEL."""
    name = settings.AUTO_LOAD_MODEL
    if not name:
        return None
    model = _registered(name)
    state = {"configured": name, "resident": resident, "applied": model is not None and resident == model.name}
    if state["applied"]:
        return state
    held = Model.objects.filter(name=resident).first() if resident else None
    lease = lease_live(model=held) if held is not None else None
    if model is None:
        reason = f"AUTO_LOAD_MODEL names {name!r}, which is not registered"
    elif held is not None and held.locked:
        reason = f"model {held.name!r} is resident and locked: unlock it and load {model.name!r}, or restart"
    elif lease is not None:
        reason = (
            f"model {lease.model.name!r} is leased by {lease.holder!r} until "
            f"{lease.expires_at.isoformat()}: AUTO_LOAD_MODEL waits for the lease to end and a restart"
        )
    elif Job.objects.filter(kind=Job.Kind.MODEL_LOAD, model=model, status__in=Job.ACTIVE).exists():
        reason = f"model {model.name!r} is loading"
    elif resident:
        reason = f"model {resident!r} was loaded since start-up (a request or an operator chose it)"
    else:
        reason = f"model {model.name!r} is not resident (its start-up load did not finish: see its job)"
    return {**state, "reason": reason}


def _registered(name: str) -> Model | None:
    try:
        return model_by_name_or_id(name)
    except ModelNotFound:
        return None


def auto_attach_targets() -> list[tuple[SAE, int]]:
    """The (SAE, layer) pairs AUTO_ATTACH_SAES names; unknown names are errors."""

    targets: list[tuple[SAE, int]] = []
    for entry in settings.AUTO_ATTACH_SAES:
        name, _, layer = entry.partition("@")
        sae = SAE.objects.filter(Q(pk=name) | Q(name=name)).first()
        if sae is None:
            raise SAENotFound(f"AUTO_ATTACH_SAES names {name!r}, which is not registered", details={"sae": name})
        chosen = int(layer) if layer else sae.trained_on_layer
        if chosen is None:
            raise ValidationFailed(
                f"SAE {name!r} does not say which layer it was trained on; write {name}@<layer>", details={"sae": name}
            )
        targets.append((sae, chosen))
    return targets


def auto_attach(*, load_job_id: int | None, timeout_s: float) -> list:
    """Attach AUTO_ATTACH_SAES once the start-up load has finished (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while load_job_id is not None:
        job = Job.objects.get(pk=load_job_id)
        if job.status in Job.FINISHED:
            if job.status != Job.Status.SUCCEEDED:
                log.warning("auto_attach_skipped", reason=f"start-up load {job.status}", error=job.error)
                return []
            break
        if time.monotonic() > deadline:
            log.warning("auto_attach_skipped", reason="start-up load still running", timeout_s=timeout_s)
            return []
        time.sleep(0.25)
    results = services.sae_attach_set(items=auto_attach_targets())
    log.info("auto_attached", attachments=[f"{r.sae_id}@{r.layer}" for r in results])
    return results
