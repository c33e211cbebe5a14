"""Download services: models and SAEs from the hub into MODEL_CACHE_DIR / SAE_CACHE_DIR.

Same style as ``registry.services`` (keyword-only ``<entity>_<verb>`` functions called by
views, tasks and commands alike). A download is two halves:

- ``*_download_start`` (this module) runs in the request: it asks the hub about the
  repository (so a missing repository, a gated one without a token or a hub outage is
  answered at once, with its code), creates the row (``downloading``) and a ``Job``, and
  enqueues the task after commit. The per-request ``hf_token`` travels to the task as an
  argument only. ``*_preview`` says what a download would fetch; ``download_cancel``
  asks a running one to stop.
- ``*_download_run`` (``registry.download_run``) is the task body: it downloads the
  selected files one by one (``registry.transfer``: huggingface_hub's ``hf_hub_download``,
  bytes and percent on the job row, progress events, cancel and DOWNLOAD_TIMEOUT), and
  only then marks the row ready. A download that fails or is cancelled leaves no files
  behind and nothing marked ready.

Only safetensors, JSON, tokenizer and template files are fetched for a model (pickle
formats are never downloaded, let alone loaded); ``.py`` files only with
``trust_remote_code``, which the operator allows (ALLOW_REMOTE_CODE) to admin keys alone.
A download checks the free space of its cache first (507 INSUFFICIENT_STORAGE).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import audited
from core import events, jobs
from core.errors import SAEInvalid, UnsupportedModel
from registry import hub, job_lifecycle, selectors, sizing
from registry.access import check_remote_code
from registry.errors import (
    AmbiguousModelName,
    GatedModelNoToken,
    JobFinished,
    ModelAlreadyExists,
    ModelInvalid,
)
from registry.hub_files import (
    describe_sae_path,
    gguf_quantization,
    gguf_quants,
    sae_dir_of,
    select_model_files,
    select_sae_files,
    sibling_files,
    split_repo_quant,
)
from registry.models import SAE, Job, Model
from registry.services import check_backend_format
from registry.transfer import check_free_space

log = structlog.get_logger(__name__)

# --- models ------------------------------------------------------------------------------


def _model_repo_checks(
    *, repo_id: str, revision: str, token: str | bool, trust_remote_code: bool
) -> tuple[Any, list[tuple[str, int]]]:
    info = hub.model_info(repo_id=repo_id, revision=revision, token=token)
    files = select_model_files(sibling_files(info), trust_remote_code=trust_remote_code)
    if info.gated and not token:
        raise GatedModelNoToken(
            f"Repository {repo_id!r} is gated: accept its license on the hub and send an hf_token",
            details={"repo_id": repo_id},
        )
    if info.gated:
        # the listing is public; whether this token may read the files is not
        probe = next((n for n, _ in files if n == "config.json"), files[0][0] if files else None)
        if probe:
            hub.file_metadata(repo_id=repo_id, filename=probe, revision=info.sha or revision, token=token)
    return info, files


def model_preview(*, repo_id: str, revision: str = "main", hf_token: str | None = None) -> dict[str, Any]:
    """What a download would fetch, and what loading it would need, before any download."""
    token = hub.resolve_token(hf_token)
    info, files = _model_repo_checks(repo_id=repo_id, revision=revision, token=token, trust_remote_code=True)
    names = {n for n, _ in files}
    config: dict[str, Any] = {}
    if "config.json" in names:
        try:
            config = json.loads(
                hub.read_small_file(repo_id=repo_id, filename="config.json", revision=info.sha or revision, token=token)
            )
        except ValueError:
            config = {}
    elif isinstance(info.config, dict):
        config = dict(info.config)
    weights = [(n, s) for n, s in files if n.endswith(".safetensors")]
    params = None
    if info.safetensors is not None and getattr(info.safetensors, "total", None):
        params = int(info.safetensors.total)
    elif weights:
        dtype_bytes = 4 if str(config.get("torch_dtype") or config.get("dtype")) == "float32" else 2
        params = sum(s for _, s in weights) // dtype_bytes
    requires_remote_code = bool(config.get("auto_map"))
    download_files = [(n, s) for n, s in files if not n.endswith(".py") or requires_remote_code]
    disk = sum(s for _, s in download_files)
    card = getattr(info, "card_data", None)
    return {
        "name": repo_id.rsplit("/", 1)[-1],
        "repo_id": repo_id,
        "revision": revision,
        "sha": info.sha,
        "params": sizing.format_params(params),
        "parameter_count": params,
        "architecture": (config.get("architectures") or [None])[0],
        "architectures": config.get("architectures") or [],
        "model_type": config.get("model_type"),
        "num_layers": sizing._first(sizing.text_config(config), sizing._LAYER_KEYS),
        "hidden_size": sizing._first(sizing.text_config(config), sizing._HIDDEN_KEYS),
        "context_length": sizing.context_length(config),
        "requires_trust_remote_code": requires_remote_code,
        "is_gated": bool(info.gated),
        "has_safetensors": bool(weights),
        "disk_size_mb": round(disk / 2**20, 3),
        "estimated_sizes": {
            quant: {"disk_mb": round(disk / 2**20, 3), "memory_mb": sizes["memory_mb"]}
            for quant, sizes in sizing.estimates_by_quantization(parameter_count=params or 0, config=config).items()
        }
        if params
        else None,
        "files": [{"path": n, "size_bytes": s} for n, s in download_files],
        "downloads": info.downloads or 0,
        "likes": info.likes or 0,
        "tags": info.tags or [],
        "pipeline_tag": info.pipeline_tag,
        "license": getattr(card, "license", None) if card is not None else None,
    }


def _first(kind: str, name_key: str):
    def target(kwargs: dict[str, Any], result: Any) -> tuple[str, Any, str]:
        row = result[0] if result else None
        if row is None:
            return (kind, "", str(kwargs.get(name_key) or ""))
        return (kind, row.pk, row.name)

    return target


# the hub token is never kept (audit.services drops it by name anyway)
@audited(
    "model.download",
    _first("model", "repo_id"),
    params=lambda kw: {
        k: kw[k] for k in ("repo_id", "revision", "quantization", "trust_remote_code", "custom_name") if k in kw
    },
    job=lambda result: result[1],
)
def model_download_start(
    *,
    repo_id: str,
    revision: str = "main",
    quantization: str = Model.Quantization.FP16,
    trust_remote_code: bool = False,
    custom_name: str | None = None,
    hf_token: str | None = None,
    dispatch: bool = True,
    backend: str = "",
) -> tuple[Model, Job]:
    """Check the repository on the hub, create the row and its job, start the task
    (``dispatch=False``: the caller runs ``model_download_run`` itself, as a command does).
    ``backend``: the one the caller will set, refused before any row if it cannot read the
    repository's format (``check_backend_format``)."""
    check_remote_code(trust_remote_code=trust_remote_code)
    revision = revision or "main"
    token = hub.resolve_token(hf_token)
    repo_id, quant = split_repo_quant(repo_id)
    info, files = _model_repo_checks(
        repo_id=repo_id, revision=revision, token=token, trust_remote_code=trust_remote_code
    )
    ggufs = gguf_quants(sibling_files(info))
    is_gguf = quant is not None or bool(ggufs and not any(n.endswith(".safetensors") for n, _ in files))
    check_backend_format(backend, Model.Format.GGUF if is_gguf else Model.Format.TRANSFORMERS)
    if is_gguf:
        return _gguf_download_start(
            repo_id=repo_id,
            quant=quant,
            ggufs=ggufs,
            info=info,
            revision=revision,
            custom_name=custom_name,
            hf_token=hf_token,
            dispatch=dispatch,
        )
    if not any(n.endswith(".safetensors") for n, _ in files):
        raise ModelInvalid(
            f"Repository {repo_id!r} has no safetensors weights at its root "
            "(pickle checkpoints are never downloaded or loaded)",
            details={"repo_id": repo_id},
        )
    config = info.config if isinstance(info.config, dict) else {}
    if config.get("auto_map") and not trust_remote_code:
        raise UnsupportedModel(
            f"Repository {repo_id!r} ships its own model code; download it "
            "with trust_remote_code=true if you trust it (an admin key, "
            "and ALLOW_REMOTE_CODE=true on the server)",
            details={"repo_id": repo_id, "requires_trust_remote_code": True},
        )
    check_free_space(files=files, cache_dir=settings.MODEL_CACHE_DIR, repo_id=repo_id)
    name = (custom_name or repo_id.rsplit("/", 1)[-1]).strip()
    with transaction.atomic():
        existing = (
            Model.objects.select_for_update()
            .filter(source=Model.Source.HUGGINGFACE, repo_id=repo_id, revision=revision, quantization=quantization)
            .first()
        )
        if existing is not None and existing.status != Model.Status.ERROR:
            raise ModelAlreadyExists(
                f"{repo_id}@{revision} ({quantization}) is already registered as {existing.name!r}",
                details={"model_id": existing.id, "name": existing.name},
            )
        clash = Model.objects.filter(name=name).exclude(pk=existing.pk if existing is not None else None).first()
        if clash is not None:
            raise ModelAlreadyExists(
                f"A model named {name!r} is already registered; choose a custom_name",
                details={"name": name, "model_id": clash.id},
            )
        if existing is not None:  # a failed or cancelled download is started again
            model = existing
            model.name, model.trust_remote_code = name, trust_remote_code
            model.status, model.error_message = Model.Status.DOWNLOADING, ""
            model.save(update_fields=["name", "trust_remote_code", "status", "error_message", "updated_at"])
        else:
            model = Model.objects.create(
                name=name,
                source=Model.Source.HUGGINGFACE,
                repo_id=repo_id,
                revision=revision,
                quantization=quantization,
                trust_remote_code=trust_remote_code,
                status=Model.Status.DOWNLOADING,
                architecture=(config.get("architectures") or [""])[0],
            )
        job = _download_job(
            model,
            target=f"{repo_id}@{revision}",
            files=files,
            info=info,
            revision=revision,
            hf_token=hf_token,
            dispatch=dispatch,
        )
    log.info(
        "model_download_started", model_id=model.id, repo_id=repo_id, revision=revision, job_id=job.id, files=len(files)
    )
    return model, job


def _download_job(
    model: Model,
    *,
    target: str,
    files: list[tuple[str, int]],
    info: Any,
    revision: str,
    hf_token: str | None,
    dispatch: bool,
) -> Job:
    """The download job of a model row, sized by its files, and (``dispatch``) its task on
    the ``downloads`` queue. hf_token only when the request brought one: HF_TOKEN is read
    by the task itself."""
    job = job_lifecycle.job_create(kind=Job.Kind.MODEL_DOWNLOAD, target=target, model=model)
    job.bytes_total = sum(s for _, s in files) or None
    job.save(update_fields=["bytes_total", "updated_at"])
    if dispatch:
        jobs.enqueue(
            "registry.tasks.model_download_task",
            job.id,
            queue="downloads",
            commit=info.sha or revision,
            secret_kwargs={"hf_token": hf_token},
        )
    return job


def _gguf_download_start(
    *,
    repo_id: str,
    quant: str | None,
    ggufs: dict[str, list[tuple[str, int]]],
    info: Any,
    revision: str,
    custom_name: str | None,
    hf_token: str | None,
    dispatch: bool,
) -> tuple[Model, Job]:
    """A GGUF repository: the quantization named (``repo:QUANT``), or the only one there;
    a bare name over several is ambiguous. The row is a GGUF model (the llamacpp backend)
    named ``repo:QUANT`` unless a custom name is given."""
    available = sorted(ggufs)
    if quant is None:
        if len(available) != 1:
            raise AmbiguousModelName(
                f"Repository {repo_id!r} holds {len(available)} GGUF quantizations; name one as "
                f"{repo_id}:QUANT ({', '.join(available)})",
                details={"repo_id": repo_id, "quantizations": available},
            )
        quant = available[0]
    if quant not in ggufs:
        raise ModelInvalid(
            f"Repository {repo_id!r} has no {quant} GGUF file"
            + (f" (it has {', '.join(available)})" if available else ""),
            details={"repo_id": repo_id, "quantization": quant, "quantizations": available},
        )
    files = ggufs[quant]
    check_free_space(files=files, cache_dir=settings.MODEL_CACHE_DIR, repo_id=repo_id)
    first = files[0][0]
    name = (custom_name or f"{repo_id.rsplit('/', 1)[-1]}:{quant}").strip()
    with transaction.atomic():
        existing = (
            Model.objects.select_for_update()
            .filter(
                source=Model.Source.HUGGINGFACE,
                repo_id=repo_id,
                revision=revision,
                format=Model.Format.GGUF,
                gguf_file=first,
            )
            .first()
        )
        if existing is not None and existing.status != Model.Status.ERROR:
            raise ModelAlreadyExists(
                f"{repo_id}@{revision} ({quant}) is already registered as {existing.name!r}",
                details={"model_id": existing.id, "name": existing.name},
            )
        clash = Model.objects.filter(name=name).exclude(pk=existing.pk if existing is not None else None).first()
        if clash is not None:
            raise ModelAlreadyExists(
                f"A model named {name!r} is already registered; choose a custom_name",
                details={"name": name, "model_id": clash.id},
            )
        if existing is not None:
            model = existing
            model.name, model.status, model.error_message = name, Model.Status.DOWNLOADING, ""
            model.save(update_fields=["name", "status", "error_message", "updated_at"])
        else:
            model = Model.objects.create(
                name=name,
                source=Model.Source.HUGGINGFACE,
                repo_id=repo_id,
                revision=revision,
                format=Model.Format.GGUF,
                gguf_file=first,
                quantization=gguf_quantization(quant),
                status=Model.Status.DOWNLOADING,
            )
        job = _download_job(
            model,
            target=f"{repo_id}:{quant}@{revision}",
            files=files,
            info=info,
            revision=revision,
            hf_token=hf_token,
            dispatch=dispatch,
        )
    log.info(
        "model_download_started",
        model_id=model.id,
        repo_id=repo_id,
        quantization=quant,
        revision=revision,
        job_id=job.id,
        files=len(files),
    )
    return model, job


@audited(
    "download.cancel",
    lambda kw, r: (
        "model" if isinstance(kw.get("row"), Model) else "sae",
        getattr(kw.get("row"), "pk", ""),
        getattr(kw.get("row"), "name", ""),
    ),
)
def download_cancel(*, row: Model | SAE) -> Job:
    """Ask the row's running download to stop (it stops within a moment and removes its
    files); a queued one is cancelled at once."""
    relation = "model" if isinstance(row, Model) else "sae"
    kind = Job.Kind.MODEL_DOWNLOAD if relation == "model" else Job.Kind.SAE_DOWNLOAD
    job = selectors.active_job(kinds=(kind,), **{relation: row})
    label = f"Model {row.name!r}" if relation == "model" else f"SAE {row.pk}"
    if job is None:
        raise JobFinished(
            f"{label} has no download in progress", details={f"{relation}_id": row.pk, "status": row.status}
        )
    job = job_lifecycle.job_cancel(job=job)
    if job.status == Job.Status.CANCELLED:  # it never started
        type(row).objects.filter(pk=row.pk).update(
            status=row.Status.ERROR, error_message="Download cancelled", updated_at=timezone.now()
        )
        events.publish(
            f"{relation}:download:error", {"job_id": job.id, f"{relation}_id": row.pk, "error": "Download cancelled"}
        )
    return job


# --- SAEs ----------------------------------------------------------------------------------


def sae_preview(*, repository_id: str, revision: str = "main", hf_token: str | None = None) -> dict[str, Any]:
    """The SAEs a repository offers (one entry per SAE file), without downloading."""
    token = hub.resolve_token(hf_token)
    info = hub.model_info(repo_id=repository_id, revision=revision, token=token)
    files = []
    for name, size in sibling_files(info):
        base = PurePosixPath(name).name
        if base in ("params.npz", "sae_weights.safetensors"):
            files.append(
                {
                    "path": name,
                    "size_bytes": size,
                    **describe_sae_path(name),
                    "layout": "gemmascope" if base == "params.npz" else "saelens",
                }
            )
    return {
        "repository_id": repository_id,
        "revision": revision,
        "sha": info.sha,
        "is_gated": bool(info.gated),
        "model_id": repository_id.rsplit("/", 1)[-1],
        "files": files,
        "total_files": len(files),
    }


@audited(
    "sae.download",
    _first("sae", "repository_id"),
    params=lambda kw: {k: kw[k] for k in ("repository_id", "file_path", "revision") if k in kw},
    job=lambda result: result[1],
)
def sae_download_start(
    *,
    repository_id: str,
    file_path: str = "",
    revision: str = "main",
    hf_token: str | None = None,
    dispatch: bool = True,
) -> tuple[SAE, Job | None, str]:
    """Idempotent per repository + revision + file path. Returns the row, the job (None
    when nothing is downloaded) and the documented status: downloading, cached, attached
    or already_downloading."""
    revision = revision or "main"
    file_path = (file_path or "").strip("/")
    existing = SAE.objects.filter(repository_id=repository_id, revision=revision, file_path=file_path).first()
    if existing is not None and existing.status == SAE.Status.ATTACHED:
        return existing, None, "attached"
    if existing is not None and existing.status == SAE.Status.READY:
        return existing, None, "cached"
    if existing is not None and existing.status == SAE.Status.DOWNLOADING:
        job = selectors.active_job(kinds=(Job.Kind.SAE_DOWNLOAD,), sae=existing)
        return existing, job, "already_downloading"
    token = hub.resolve_token(hf_token)
    info = hub.model_info(repo_id=repository_id, revision=revision, token=token)
    files = select_sae_files(sibling_files(info), file_path)
    if not files:
        raise SAEInvalid(
            f"No SAE files (.json, .safetensors, .npz) at {file_path or 'the root'} of {repository_id!r}",
            details={"repository_id": repository_id, "file_path": file_path},
        )
    if info.gated:
        if not token:
            raise GatedModelNoToken(
                f"Repository {repository_id!r} is gated: send an hf_token", details={"repo_id": repository_id}
            )
        hub.file_metadata(repo_id=repository_id, filename=files[0][0], revision=info.sha or revision, token=token)
    check_free_space(files=files, cache_dir=settings.SAE_CACHE_DIR, repo_id=repository_id)
    hints = describe_sae_path(file_path)
    with transaction.atomic():
        sae = SAE.objects.select_for_update().filter(pk=existing.pk).first() if existing is not None else None
        if sae is None:
            sae = SAE.objects.create(
                name=(PurePosixPath(sae_dir_of(file_path)).name if file_path else repository_id.rsplit("/", 1)[-1])
                or repository_id.rsplit("/", 1)[-1],
                repository_id=repository_id,
                revision=revision,
                file_path=file_path,
                status=SAE.Status.DOWNLOADING,
                trained_on_layer=hints["layer"],
                average_l0=hints["average_l0"],
            )
        else:
            sae.status, sae.error_message = SAE.Status.DOWNLOADING, ""
            sae.save(update_fields=["status", "error_message", "updated_at"])
        job = job_lifecycle.job_create(
            kind=Job.Kind.SAE_DOWNLOAD, target=f"{repository_id}@{revision}:{file_path}"[:500], sae=sae
        )
        job.bytes_total = sum(s for _, s in files) or None
        job.save(update_fields=["bytes_total", "updated_at"])
        if dispatch:
            jobs.enqueue(
                "registry.tasks.sae_download_task",
                job.id,
                queue="downloads",
                commit=info.sha or revision,
                secret_kwargs={"hf_token": hf_token},
            )
    log.info("sae_download_started", sae_id=sae.id, repository_id=repository_id, file_path=file_path, job_id=job.id)
    return sae, job, "downloading"
