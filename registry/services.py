"""Registry mutations. Views, admin actions, commands, tasks and the engine bridge all
call these functions; none of this logic lives in views, serializers or ``save()``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from millm_site import events
from millm_site.errors import (
    InvalidLocalPath,
    JobFinished,
    ModelAlreadyExists,
    ModelInvalid,
    ModelLoaded,
    ModelLocked,
    SAEAlreadyAttached,
    SAEInvalid,
)
from registry.models import SAE, Attachment, Job, Model

log = structlog.get_logger(__name__)

# Registering one of these (or anything under them) as a model directory would let the
# model loader and prune_cache walk system files; the original refused them too.
SYSTEM_DIRECTORIES = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/run", "/sbin", "/sys", "/usr/bin", "/usr/lib", "/usr/sbin", "/usr/include",
    "/var/lib", "/var/log", "/var/run",
)


def _check_local_path(raw: str) -> Path:
    if not raw or not raw.strip():
        raise InvalidLocalPath("local_path is required for a local model",
                               details={"local_path": raw})
    path = Path(raw.strip())
    if not path.is_absolute():
        raise InvalidLocalPath("local_path must be an absolute path", details={"local_path": raw})
    resolved = path.resolve()
    if str(resolved) == "/" or any(
            str(resolved) == d or str(resolved).startswith(d + "/") for d in SYSTEM_DIRECTORIES):
        raise InvalidLocalPath(f"{resolved} is a system directory and cannot hold a model",
                               details={"local_path": raw})
    if not resolved.exists():
        raise InvalidLocalPath(f"{resolved} does not exist", details={"local_path": raw})
    return resolved


def _dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _describe_transformers_dir(path: Path, quantization: str | None = None) -> dict[str, Any]:
    import json

    from gpu_engine.errors import EngineError
    from gpu_engine.inspect import inspect_model_dir
    from registry import sizing

    try:
        info = inspect_model_dir(path)
    except EngineError as exc:
        raise ModelInvalid(f"{path} is not a readable transformers checkpoint: {exc.message}",
                           details={"local_path": str(path)}) from exc
    estimated = info.estimated_memory_bytes
    if quantization and quantization != Model.Quantization.FP32:
        config = json.loads((path / "config.json").read_text())
        estimated = sizing.estimate_bytes(parameter_count=info.param_count, config=config,
                                          quantization=quantization)
    return {
        "architecture": info.architecture_class,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "context_length": info.context_length,
        "parameter_count": info.param_count,
        "disk_size_bytes": info.disk_size_bytes,
        "estimated_memory_bytes": estimated,
    }


def _describe_gguf_file(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - gguf raises assorted errors on bad files
        raise ModelInvalid(f"{path.name} is not a readable GGUF file: {exc}",
                           details={"local_path": str(path)}) from exc

    def field(name: str) -> Any:
        item = reader.fields.get(name)
        return item.contents() if item is not None else None

    arch = field("general.architecture") or ""
    params = sum(int(t.n_elements) for t in reader.tensors)
    size = path.stat().st_size
    return {
        "architecture": str(arch),
        "num_layers": field(f"{arch}.block_count"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "context_length": field(f"{arch}.context_length"),
        "parameter_count": params,
        "disk_size_bytes": size,
        "estimated_memory_bytes": size,
    }


@transaction.atomic
def model_register_local(*, local_path: str, name: str | None = None,
                         quantization: str | None = None,
                         trust_remote_code: bool = False) -> Model:
    """Register a checkpoint already on disk: a transformers directory or a GGUF file."""
    path = _check_local_path(local_path)
    if path.is_file() and path.suffix == ".gguf":
        fmt, gguf_file, meta = Model.Format.GGUF, path.name, _describe_gguf_file(path)
    elif path.is_dir():
        fmt, gguf_file, meta = (Model.Format.TRANSFORMERS, "",
                                _describe_transformers_dir(path, quantization))
    else:
        raise InvalidLocalPath(f"{path} is neither a model directory nor a .gguf file",
                               details={"local_path": local_path})
    name = (name or (path.stem if path.is_file() else path.name)).strip()
    if Model.objects.filter(name=name).exists():
        raise ModelAlreadyExists(f"A model named {name!r} is already registered",
                                 details={"name": name})
    model = Model.objects.create(
        name=name, source=Model.Source.LOCAL, local_path=str(path), format=fmt,
        gguf_file=gguf_file,
        quantization=quantization or Model.Quantization.FP32,
        trust_remote_code=trust_remote_code, status=Model.Status.READY, **meta,
    )
    log.info("model_registered", model_id=model.id, name=name, path=str(path))
    return model


def model_refresh_metadata(*, model: Model) -> Model:
    """Re-read architecture and sizes from the files (after a manual copy, say)."""
    if not model.local_path:
        raise ModelInvalid(f"Model {model.name!r} has no files yet",
                           details={"model_id": model.id})
    path = Path(model.local_path)
    meta = (_describe_gguf_file(path) if model.format == Model.Format.GGUF
            else _describe_transformers_dir(path, model.quantization))
    for key, value in meta.items():
        setattr(model, key, value)
    model.save(update_fields=[*meta.keys(), "updated_at"])
    return model


def model_set_status(*, model: Model, status: str, error: str = "", device: str = "",
                     dtype: str = "") -> Model:
    model.status = status
    model.error_message = error
    fields = ["status", "error_message", "updated_at"]
    if status == Model.Status.LOADED:
        model.loaded_at = timezone.now()
        model.device, model.dtype = device, dtype
        fields += ["loaded_at", "device", "dtype"]
    elif status not in (Model.Status.UNLOADING,):
        model.device = model.dtype = ""
        fields += ["device", "dtype"]
    model.save(update_fields=fields)
    return model


def model_lock(*, model: Model) -> Model:
    Model.objects.filter(pk=model.pk).update(locked=True, updated_at=timezone.now())
    model.refresh_from_db()
    return model


def model_unlock(*, model: Model) -> Model:
    Model.objects.filter(pk=model.pk).update(locked=False, updated_at=timezone.now())
    model.refresh_from_db()
    return model


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


@transaction.atomic
def model_delete(*, model: Model) -> None:
    """Delete the row, and the files when miLLM downloaded them into its cache.

    A model registered from a user's own directory keeps its files: we only ever remove
    what we put under MODEL_CACHE_DIR. A download in progress is cancelled first.
    """
    from registry.downloads import model_target_dir

    model = Model.objects.select_for_update().get(pk=model.pk)
    if model.locked:
        raise ModelLocked(f"Model {model.name!r} is locked; unlock it first",
                          details={"model_id": model.id})
    if model.status in (Model.Status.LOADED, Model.Status.LOADING, Model.Status.UNLOADING):
        raise ModelLoaded(f"Model {model.name!r} is {model.status}; unload it first",
                          details={"model_id": model.id, "status": model.status})
    Job.objects.filter(model=model, status__in=(Job.Status.QUEUED, Job.Status.RUNNING)).update(
        cancel_requested=True, updated_at=timezone.now())
    cache = Path(settings.MODEL_CACHE_DIR)
    candidates = [Path(model.local_path)] if model.local_path else []
    if model.source == Model.Source.HUGGINGFACE:
        candidates.append(model_target_dir(model))
    model_id = model.id
    model.delete()
    for files in candidates:
        if _is_under(files, cache) and files.exists():
            transaction.on_commit(lambda files=files: _remove(files))
    log.info("model_deleted", model_id=model_id)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- SAEs ------------------------------------------------------------------------------

def _describe_sae(path: Path) -> dict[str, Any]:
    from gpu_engine.errors import EngineError
    from gpu_engine.sae import read_sae_metadata

    try:
        meta = read_sae_metadata(path)
    except EngineError as exc:
        raise SAEInvalid(f"{path} is not a readable SAE: {exc.message}",
                         details={"local_path": str(path)}) from exc
    return {
        "format": meta.layout,
        "d_in": meta.d_in,
        "d_sae": meta.d_sae,
        "width": meta.d_sae,
        "activation": meta.activation,
        "topk_k": meta.k,
        "trained_on_model": meta.model_name or "",
        "trained_on_layer": meta.layer,
        "hook_name": meta.hook_name or "",
    }


@transaction.atomic
def sae_register_local(*, local_path: str, name: str | None = None,
                       repository_id: str = "", file_path: str = "",
                       average_l0: float | None = None,
                       trained_on_model: str | None = None,
                       trained_on_layer: int | None = None) -> SAE:
    """Register an SAE directory (SAELens) or params.npz (Gemma Scope) already on disk.

    What the files say about the model and layer the SAE was trained on wins; the hints
    fill in what they do not say (a Gemma Scope params.npz names neither).
    """
    path = _check_local_path(local_path)
    meta = _describe_sae(path)
    if not meta["trained_on_model"] and trained_on_model:
        meta["trained_on_model"] = trained_on_model
    if meta["trained_on_layer"] is None and trained_on_layer is not None:
        meta["trained_on_layer"] = trained_on_layer
    if repository_id and SAE.objects.filter(repository_id=repository_id, revision="main",
                                            file_path=file_path).exists():
        raise SAEInvalid(f"SAE {repository_id}/{file_path} is already registered",
                         details={"repository_id": repository_id, "file_path": file_path})
    default_name = path.name if path.is_dir() else path.parent.name
    sae = SAE.objects.create(
        name=(name or default_name).strip(),
        repository_id=repository_id, file_path=file_path, local_path=str(path),
        average_l0=average_l0, status=SAE.Status.READY, **meta,
    )
    log.info("sae_registered", sae_id=sae.id, path=str(path))
    return sae


@transaction.atomic
def sae_delete(*, sae: SAE) -> None:
    """Delete the row and, for a downloaded SAE, its files; refused while attached (409)."""
    from registry.downloads import sae_target_dir

    sae = SAE.objects.select_for_update().get(pk=sae.pk)
    if sae.status == SAE.Status.ATTACHED or sae.attachments.exists():
        raise SAEAlreadyAttached(f"SAE {sae.id} is attached; detach it first",
                                 details={"sae_id": sae.id})
    Job.objects.filter(sae=sae, status__in=(Job.Status.QUEUED, Job.Status.RUNNING)).update(
        cancel_requested=True, updated_at=timezone.now())
    cache = Path(settings.SAE_CACHE_DIR)
    candidates = [Path(sae.local_path)] if sae.local_path else []
    if sae.repository_id:
        candidates.append(sae_target_dir(sae))
    sae.delete()
    for files in candidates:
        if _is_under(files, cache) and files.exists():
            transaction.on_commit(lambda files=files: _remove(files))


# --- Jobs ------------------------------------------------------------------------------

_JOB_EVENT_PREFIX = {
    Job.Kind.MODEL_DOWNLOAD: "model:download",
    Job.Kind.SAE_DOWNLOAD: "sae:download",
    Job.Kind.MODEL_LOAD: "model:load",
}


def _job_payload(job: Job) -> dict[str, Any]:
    return {"job_id": job.id, "kind": job.kind, "model_id": job.model_id, "sae_id": job.sae_id,
            "status": job.status, "progress": job.progress, "percent": job.progress,
            "stage": job.stage, "bytes_done": job.bytes_done, "bytes_total": job.bytes_total}


def job_create(*, kind: str, target: str, model: Model | None = None,
               sae: SAE | None = None) -> Job:
    return Job.objects.create(kind=kind, target=target, model=model, sae=sae)


def job_claim(*, job: Job, stage: str = "") -> bool:
    """Move a queued job to running, atomically: False when another worker (a redelivered
    task, a second dispatch) already has it or it has ended, and then nothing is run."""
    now = timezone.now()
    claimed = Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED,
                                 cancel_requested=False).update(
        status=Job.Status.RUNNING, started_at=now, stage=stage, updated_at=now)
    if claimed:
        job.status, job.started_at, job.stage = Job.Status.RUNNING, now, stage
    return bool(claimed)


def job_start(*, job: Job, stage: str = "") -> Job:
    job.status = Job.Status.RUNNING
    job.started_at = timezone.now()
    job.stage = stage
    job.save(update_fields=["status", "started_at", "stage", "updated_at"])
    return job


def job_progress(*, job: Job, progress: int, stage: str | None = None,
                 bytes_done: int | None = None, bytes_total: int | None = None) -> Job:
    """Record progress on the row and push it to WebSocket listeners."""
    job.progress = max(0, min(100, int(progress)))
    fields = ["progress", "updated_at"]
    if stage is not None:
        job.stage = stage
        fields.append("stage")
    if bytes_done is not None:
        job.bytes_done = bytes_done
        fields.append("bytes_done")
    if bytes_total is not None:
        job.bytes_total = bytes_total
        fields.append("bytes_total")
    job.save(update_fields=fields)
    prefix = _JOB_EVENT_PREFIX.get(job.kind)
    if prefix:
        events.publish(f"{prefix}:progress", _job_payload(job))
    return job


def job_finish(*, job: Job, status: str, error: str = "") -> Job:
    if status not in Job.FINISHED:
        raise ValueError(f"{status} is not a final job status")
    job.status = status
    job.error = error
    job.finished_at = timezone.now()
    if status == Job.Status.SUCCEEDED:
        job.progress = 100
    job.save(update_fields=["status", "error", "finished_at", "progress", "updated_at"])
    prefix = _JOB_EVENT_PREFIX.get(job.kind)
    if prefix:
        suffix = "complete" if status == Job.Status.SUCCEEDED else "error"
        events.publish(f"{prefix}:{suffix}", {**_job_payload(job), "error": error})
    return job


@transaction.atomic
def job_cancel(*, job: Job) -> Job:
    """Ask a running job to stop; a queued one is cancelled at once."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.status in Job.FINISHED:
        raise JobFinished(f"Job {job.id} already {job.status}",
                          details={"job_id": job.id, "status": job.status})
    job.cancel_requested = True
    if job.status == Job.Status.QUEUED:
        job.status = Job.Status.CANCELLED
        job.finished_at = timezone.now()
    job.save(update_fields=["cancel_requested", "status", "finished_at", "updated_at"])
    return job


# --- Demo assets -----------------------------------------------------------------------

def demo_assets_install(*, root: Path, seed: int = 0, include_demo: bool = True
                        ) -> tuple[list[Model], list[SAE]]:
    """Build the offline demo/test assets (cached) and register every one of them.

    Idempotent: a model or SAE already registered at the same path is refreshed, not
    duplicated, so the run command can call this on every start.
    """
    from gpu_engine.assets import ensure_assets

    manifest = ensure_assets(Path(root), seed=seed, include_demo=include_demo)
    models: list[Model] = []
    for asset in manifest.models.values():
        existing = Model.objects.filter(name=asset.name).first()
        if existing is not None and existing.local_path == str(Path(asset.path).resolve()):
            models.append(model_refresh_metadata(model=existing))
            continue
        if existing is not None:
            raise ModelAlreadyExists(
                f"A model named {asset.name!r} is registered at another path "
                f"({existing.local_path}); delete it or rename it first",
                details={"name": asset.name})
        models.append(model_register_local(local_path=str(asset.path), name=asset.name))
    saes: list[SAE] = []
    for asset in manifest.saes.values():
        path = str(Path(asset.path).resolve())
        existing = SAE.objects.filter(local_path=path).first()
        saes.append(existing or sae_register_local(
            local_path=path, name=asset.name, trained_on_model=asset.model_name,
            trained_on_layer=asset.layer))
    return models, saes


# --- Engine operations -----------------------------------------------------------------
# These are the only places that change what the engine holds; each call records the
# outcome on the rows (status, attachments) so the database always says what is resident.

def _engine():
    from inference.engine_client import get_engine_client

    return get_engine_client()


def _engine_errors():
    from gpu_engine.errors import EngineError

    return EngineError


def _check_free_memory(model: Model, device: str) -> None:
    """Refuse a CUDA load whose estimate exceeds the card's free memory (507)."""
    if not device.startswith("cuda") or not model.estimated_memory_bytes:
        return
    # asked of the engine's host (its heartbeat, in distributed mode): no torch here
    free = _engine().free_memory(device)
    if free is None:
        return
    resident = Model.objects.filter(status=Model.Status.LOADED).exclude(pk=model.pk).first()
    # the resident model's memory comes back before the new weights arrive
    reclaim = (resident.estimated_memory_bytes or 0) if resident is not None else 0
    if model.estimated_memory_bytes > free + reclaim:
        from millm_site.errors import InsufficientMemory

        raise InsufficientMemory(
            f"Model {model.name!r} needs about {model.estimated_memory_bytes / 2**20:.0f} MB; "
            f"{(free + reclaim) / 2**20:.0f} MB are free on {device}",
            details={"model_id": model.id, "estimated_memory_mb":
                     round(model.estimated_memory_bytes / 2**20),
                     "free_mb": round((free + reclaim) / 2**20), "device": device})


# Quantizations the transformers backend can apply at load: FP32 and FP16 load at the
# engine's dtype (MILLM_ENGINE_DTYPE); 8/4/2-bit loads need bitsandbytes, not in this build.
LOADABLE_QUANTIZATIONS = (Model.Quantization.FP32, Model.Quantization.FP16)


def _check_quantization(model: Model) -> None:
    from millm_site.errors import UnsupportedQuantization

    if model.format == Model.Format.TRANSFORMERS and \
            model.quantization not in LOADABLE_QUANTIZATIONS:
        raise UnsupportedQuantization(
            f"Model {model.name!r} is registered as {model.quantization}; this build loads "
            "transformers checkpoints at FP32/FP16 only (no bitsandbytes)",
            details={"model_id": model.id, "quantization": model.quantization,
                     "supported": list(LOADABLE_QUANTIZATIONS)})


def model_load(*, model: Model, job: Job | None = None) -> Model:
    """Load ``model`` into the engine (replacing the resident one) and record it.

    Synchronous: the API runs it in a background job (``model_load_enqueue``), /v1 on its
    own thread for an on-demand load. Progress goes on the job row and out as
    ``model:load:progress`` events.
    """
    from gpu_engine.protocol import LoadModelJob
    from inference.engine_client import resolve_device_and_dtype
    from millm_site import metrics
    from millm_site.errors import UnsupportedModel, from_engine_error

    job = job or job_create(kind=Job.Kind.MODEL_LOAD, target=model.name, model=model)
    try:
        model.refresh_from_db()
        resident = Model.objects.filter(status=Model.Status.LOADED).exclude(pk=model.pk).first()
        if resident is not None and resident.locked:
            raise ModelLocked(f"Model {resident.name!r} is resident and locked",
                              details={"model_id": resident.id})
        if model.format == Model.Format.GGUF:
            raise UnsupportedModel("GGUF models need the llama.cpp backend, which this build "
                                   "does not include", details={"model_id": model.id})
        if model.status == Model.Status.DOWNLOADING or not model.local_path:
            raise ModelInvalid(f"Model {model.name!r} has no files yet",
                               details={"model_id": model.id})
        _check_quantization(model)
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE,
                                                 settings.MILLM_ENGINE_DTYPE)
        job_start(job=job, stage="preparing")
        job_progress(job=job, progress=5, stage="checking memory")
        _check_free_memory(model, device)
    except Exception as exc:
        if job.status not in Job.FINISHED:
            job_finish(job=job, status=Job.Status.FAILED, error=getattr(exc, "message", str(exc)))
        metrics.record_load(operation="load", outcome="refused")
        raise
    model_set_status(model=model, status=Model.Status.LOADING)
    job_progress(job=job, progress=10, stage="loading weights")
    try:
        _engine().load_model(LoadModelJob(
            model_id=model.name, path=model.local_path, dtype=dtype, device=device,
            trust_remote_code=model.trust_remote_code,
            pack_cpu_weights=settings.MILLM_ENGINE_PACK_WEIGHTS))
    except _engine_errors() as exc:
        error = from_engine_error(exc)
        model_set_status(model=model, status=Model.Status.ERROR, error=error.message)
        job_finish(job=job, status=Job.Status.FAILED, error=error.message)
        metrics.record_load(operation="load", outcome="failed")
        raise error from exc
    except BaseException as exc:
        model_set_status(model=model, status=Model.Status.ERROR, error=str(exc)[:500])
        job_finish(job=job, status=Job.Status.FAILED, error=type(exc).__name__)
        metrics.record_load(operation="load", outcome="failed")
        raise
    with transaction.atomic():
        if resident is not None:
            _forget_model_state(resident)
        Attachment.objects.filter(model=model).delete()
        model_set_status(model=model, status=Model.Status.LOADED, device=device, dtype=dtype)
    if resident is not None:
        events.publish("model:unload:complete", {"model_id": resident.id,
                                                 "reason": "replaced"})
    job_progress(job=job, progress=95, stage="recorded")
    job_finish(job=job, status=Job.Status.SUCCEEDED)
    metrics.record_load(operation="load", outcome="succeeded")
    log.info("model_loaded", model_id=model.id, device=device, dtype=dtype)
    return model


def _forget_model_state(model: Model) -> None:
    from leases.services import lease_end_for_model
    from steering.live import live_forget

    live_forget(attachments=Attachment.objects.filter(model=model))
    lease_end_for_model(model_id=model.pk)  # a lease ends with its model's residency
    Attachment.objects.filter(model=model).delete()
    SAE.objects.filter(status=SAE.Status.ATTACHED).exclude(attachments__isnull=False).update(
        status=SAE.Status.READY)
    Model.objects.filter(pk=model.pk).update(status=Model.Status.READY, locked=False,
                                             device="", dtype="", updated_at=timezone.now())


def _uses_of(name: str) -> int:
    """/v1 requests currently generating on ``name`` in this process."""
    try:
        from inference.residency import get_residency
    except ImportError:
        return 0
    return int(get_residency().active().get(name, 0))


def model_unload(*, model: Model, job: Job | None = None) -> Model:
    """Unload the resident model: new /v1 requests are refused (the row says
    ``unloading``: 503 model_busy), the running ones get up to GRACEFUL_UNLOAD_TIMEOUT to
    finish, then the weights go."""
    import time

    from millm_site import metrics
    from millm_site.errors import ModelBusy, ModelNotLoaded, from_engine_error

    model.refresh_from_db()
    if model.status != Model.Status.LOADED:
        raise ModelNotLoaded(f"Model {model.name!r} is not loaded",
                             details={"model_id": model.id, "status": model.status})
    if model.locked:
        raise ModelLocked(f"Model {model.name!r} is locked; unlock it first",
                          details={"model_id": model.id})
    claimed = Model.objects.filter(pk=model.pk, status=Model.Status.LOADED, locked=False
                                   ).update(status=Model.Status.UNLOADING,
                                            updated_at=timezone.now())
    if not claimed:
        raise ModelBusy(f"Model {model.name!r} changed state; retry",
                        details={"model_id": model.id}, retry_after=settings.RETRY_AFTER_UNLOAD_S)
    if job is not None:
        job_start(job=job, stage="waiting for running requests")
    deadline = time.monotonic() + float(settings.GRACEFUL_UNLOAD_TIMEOUT)
    while _uses_of(model.name) and time.monotonic() < deadline:
        time.sleep(0.05)
    remaining = max(1.0, deadline - time.monotonic())
    engine = _engine()
    try:
        try:
            engine.unload_model(timeout_s=remaining)
        except _engine_errors() as exc:
            cancel_all = getattr(engine, "cancel_all", None)
            if getattr(exc, "code", "") != "engine_busy" or cancel_all is None:
                raise
            # The running requests outlasted the grace period: they fail, the unload goes on.
            cancel_all(reason="model_unload")
            engine.unload_model(timeout_s=float(settings.GRACEFUL_UNLOAD_TIMEOUT))
    except _engine_errors() as exc:
        Model.objects.filter(pk=model.pk, status=Model.Status.UNLOADING).update(
            status=Model.Status.LOADED, updated_at=timezone.now())
        error = from_engine_error(exc)
        if isinstance(error, ModelBusy) and error.retry_after is None:
            error.retry_after = settings.RETRY_AFTER_UNLOAD_S
        if job is not None:
            job_finish(job=job, status=Job.Status.FAILED, error=error.message)
        metrics.record_load(operation="unload", outcome="failed")
        raise error from exc
    with transaction.atomic():
        _forget_model_state(model)
    model.refresh_from_db()
    events.publish("model:unload:complete", {"model_id": model.id, "reason": "unload"})
    if job is not None:
        job_finish(job=job, status=Job.Status.SUCCEEDED)
    metrics.record_load(operation="unload", outcome="succeeded")
    log.info("model_unloaded", model_id=model.id)
    return model


def _active_job(*, model: Model, kinds: tuple[str, ...]) -> Job | None:
    return Job.objects.filter(model=model, kind__in=kinds,
                              status__in=(Job.Status.QUEUED, Job.Status.RUNNING)).first()


@transaction.atomic
def model_load_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    """Start a background load (the API's route): the job row now, the load after commit.

    Idempotent while a load of the same model is queued or running (its job is returned);
    a load of another model queues behind it (MAX_LOAD_WORKERS at a time).
    """
    from millm_site import jobs
    from millm_site.errors import ModelAlreadyLoaded, ModelBusy, UnsupportedModel
    from registry import tasks

    model = Model.objects.select_for_update().get(pk=model.pk)
    existing = _active_job(model=model, kinds=(Job.Kind.MODEL_LOAD,))
    if existing is not None:
        return existing
    if Model.objects.filter(status=Model.Status.LOADED).exclude(pk=model.pk).exists():
        from leases.services import lease_check_change

        lease_check_change(operation="load", target_model=model, lease_id=lease_id)
    if model.status == Model.Status.LOADED:
        raise ModelAlreadyLoaded(f"Model {model.name!r} is already loaded",
                                 details={"model_id": model.id})
    if model.status == Model.Status.UNLOADING:
        raise ModelBusy(f"Model {model.name!r} is being unloaded",
                        details={"model_id": model.id}, retry_after=settings.RETRY_AFTER_UNLOAD_S)
    if model.status == Model.Status.DOWNLOADING or not model.local_path:
        raise ModelInvalid(f"Model {model.name!r} has no files yet (status {model.status})",
                           details={"model_id": model.id, "status": model.status})
    if model.format == Model.Format.GGUF:
        raise UnsupportedModel("GGUF models need the llama.cpp backend, which this build "
                               "does not include", details={"model_id": model.id})
    _check_quantization(model)
    resident = Model.objects.filter(status=Model.Status.LOADED).exclude(pk=model.pk).first()
    if resident is not None and resident.locked:
        raise ModelLocked(f"Model {resident.name!r} is resident and locked; unlock it first",
                          details={"model_id": resident.id})
    job = job_create(kind=Job.Kind.MODEL_LOAD, target=model.name, model=model)
    jobs.enqueue(tasks.model_load_task, job.id, queue="loads")
    return job


@transaction.atomic
def model_unload_enqueue(*, model: Model, lease_id: str | None = None) -> Job:
    from millm_site import jobs
    from millm_site.errors import ModelBusy, ModelNotLoaded
    from registry import tasks

    model = Model.objects.select_for_update().get(pk=model.pk)
    existing = _active_job(model=model, kinds=(Job.Kind.MODEL_UNLOAD,))
    if existing is not None:
        return existing
    if model.status == Model.Status.LOADED:
        from leases.services import lease_check_change

        lease_check_change(operation="unload", target_model=model, lease_id=lease_id)
    if _active_job(model=model, kinds=(Job.Kind.MODEL_LOAD,)) is not None or \
            model.status == Model.Status.LOADING:
        raise ModelBusy(f"Model {model.name!r} is being loaded; retry when it is",
                        details={"model_id": model.id}, retry_after=settings.RETRY_AFTER_LOAD_S)
    if model.status != Model.Status.LOADED:
        raise ModelNotLoaded(f"Model {model.name!r} is not loaded",
                             details={"model_id": model.id, "status": model.status})
    if model.locked:
        raise ModelLocked(f"Model {model.name!r} is locked; unlock it (or detach its SAEs) "
                          "first", details={"model_id": model.id})
    job = job_create(kind=Job.Kind.MODEL_UNLOAD, target=model.name, model=model)
    jobs.enqueue(tasks.model_unload_task, job.id, queue="loads")
    return job


def _check_sae_ready(sae: SAE) -> None:
    if sae.status not in (SAE.Status.READY, SAE.Status.ATTACHED) or not sae.local_path:
        raise SAEInvalid(f"SAE {sae.id} is not ready to attach (status {sae.status})",
                         details={"sae_id": sae.id, "status": sae.status})


def sae_attach_set(*, items: list[tuple[SAE, int]]) -> list[Any]:
    """Attach several (SAE, layer) pairs, all or nothing.

    Idempotent per (sae_id, layer): a pair that is already attached is left as it is and
    reported again; only the new pairs reach the engine, in one all-or-nothing call.
    """
    from gpu_engine.protocol import AttachResult, AttachSpec
    from millm_site.errors import ModelNotLoaded, from_engine_error

    model = Model.objects.filter(status=Model.Status.LOADED).first()
    if model is None:
        raise ModelNotLoaded("No model is loaded; load one before attaching an SAE")
    ordered: list[tuple[SAE, int]] = []
    seen: set[tuple[str, int]] = set()
    for sae, layer in items:
        if (sae.id, int(layer)) not in seen:
            seen.add((sae.id, int(layer)))
            ordered.append((sae, int(layer)))
    for sae, _ in ordered:
        _check_sae_ready(sae)
    existing = {(a.sae_id, a.layer): a for a in Attachment.objects.filter(model=model)}
    new = [(sae, layer) for sae, layer in ordered if (sae.id, layer) not in existing]
    specs = [AttachSpec(sae_id=sae.id, path=sae.local_path, layer=layer,
                        layout=sae.format or None) for sae, layer in new]
    try:
        fresh = _engine().attach_set(specs) if specs else []
    except _engine_errors() as exc:
        raise from_engine_error(exc) from exc
    by_key = {(r.sae_id, r.layer): r for r in fresh}
    with transaction.atomic():
        for (sae, _), result in zip(new, fresh, strict=True):
            Attachment.objects.update_or_create(
                sae=sae, layer=result.layer,
                defaults={"model": model, "layer_module_path": result.layer_module_path})
            SAE.objects.filter(pk=sae.pk).update(status=SAE.Status.ATTACHED,
                                                 updated_at=timezone.now())
        # Attaching locks the model, so a steered session cannot be swapped out under it.
        if fresh:
            Model.objects.filter(pk=model.pk).update(locked=True, updated_at=timezone.now())
    for result in fresh:
        events.publish("sae:attached", {"sae_id": result.sae_id, "layer": result.layer,
                                        "layer_module_path": result.layer_module_path,
                                        "model_id": model.id,
                                        "warnings": list(result.warnings)})
    results = []
    for sae, layer in ordered:
        result = by_key.get((sae.id, layer))
        if result is None:
            row = existing[(sae.id, layer)]
            result = AttachResult(sae_id=sae.id, layer=layer,
                                  layer_module_path=row.layer_module_path, d_in=sae.d_in or 0,
                                  d_sae=sae.d_sae or 0, activation=sae.activation,
                                  layout=sae.format, warnings=[])
        results.append(result)
    return results


def sae_attach(*, sae: SAE, layer: int) -> Any:
    """Attach one SAE at one layer; attaching the same pair again is refused (409)."""
    if Attachment.objects.filter(sae=sae, layer=layer).exists():
        raise SAEAlreadyAttached(f"SAE {sae.id} is already attached at layer {layer}",
                                 details={"sae_id": sae.id, "layer": layer})
    return sae_attach_set(items=[(sae, layer)])[0]


def sae_detach(*, sae: SAE, layer: int | None = None) -> list[tuple[str, int]]:
    from millm_site.errors import SAENotAttached, from_engine_error

    if not Attachment.objects.filter(sae=sae, **({} if layer is None else {"layer": layer})
                                     ).exists():
        raise SAENotAttached(f"SAE {sae.id} is not attached"
                             + ("" if layer is None else f" at layer {layer}"),
                             details={"sae_id": sae.id, "layer": layer})
    try:
        keys = _engine().detach(sae.id, layer)
    except _engine_errors() as exc:
        if getattr(exc, "code", "") != "sae_not_attached":
            raise from_engine_error(exc) from exc
        keys = []  # the engine already lost it (restart); the rows catch up below
    for _, key_layer in keys or [(sae.id, layer)]:
        attachment_forget(sae_id=sae.id, layer=key_layer)
    for sae_id, key_layer in keys:
        events.publish("sae:detached", {"sae_id": sae_id, "layer": key_layer,
                                        "reason": "detach"})
    return keys


@transaction.atomic
def attachment_forget(*, sae_id: str, layer: int | None) -> None:
    """Record that an attachment is gone (detach, or the engine dropped it after an OOM)."""
    from steering.live import live_forget

    qs = Attachment.objects.filter(sae_id=sae_id)
    if layer is not None:
        qs = qs.filter(layer=layer)
    model_ids = set(qs.values_list("model_id", flat=True))
    live_forget(attachments=qs)  # detaching clears the attachment's live steering
    qs.delete()
    if not Attachment.objects.filter(sae_id=sae_id).exists():
        SAE.objects.filter(pk=sae_id).update(status=SAE.Status.READY, updated_at=timezone.now())
    for model_id in model_ids:
        if not Attachment.objects.filter(model_id=model_id).exists():
            Model.objects.filter(pk=model_id).update(locked=False, updated_at=timezone.now())


def sae_check_compatibility(*, sae: SAE, layer: int) -> dict[str, Any]:
    """Dry run of an attach: errors (refusals) and warnings, nothing changed."""
    from millm_site.errors import ModelNotLoaded, from_engine_error

    _check_sae_ready(sae)
    if not Model.objects.filter(status=Model.Status.LOADED).exists():
        raise ModelNotLoaded("No model is loaded; compatibility is judged against the "
                             "loaded model")
    try:
        report = _engine().check_sae(sae.local_path, layer, layout=sae.format or None)
    except _engine_errors() as exc:
        raise from_engine_error(exc) from exc
    return {"compatible": bool(report.compatible), "errors": list(report.errors),
            "warnings": list(report.warnings)}
