"""The task half of a download (``registry.downloads`` is the request half): claim the
job, fetch the selected files of the repository at the revision (``registry.transfer``),
describe what arrived, and only then mark the row ready. A download that fails or is
cancelled leaves no files behind and nothing marked ready. Called by the Celery tasks
(``registry.tasks``) and, in the foreground, by the download commands.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core import metrics
from core.errors import MillmError
from registry import describe, hub, job_lifecycle, services
from registry.access import remote_code_enabled
from registry.errors import DownloadCancelled
from registry.hub_files import gguf_quant, gguf_quants, sae_dir_of, select_model_files, select_sae_files, sibling_files
from registry.models import SAE, Job, Model
from registry.transfer import (
    ProgressCallback,
    Progress,
    check_free_space,
    clean_target,
    fetch,
    model_target_dir,
    sae_target_dir,
)

log = structlog.get_logger(__name__)


def _claim_download(job_id: int, relation: str) -> tuple[Job, Model | SAE] | None:
    """The job and its row, claimed for this worker; None when it already ended, its row
    is gone, or another worker claimed it (a redelivered task never downloads twice)."""
    job = Job.objects.select_related(relation).get(pk=job_id)
    row = getattr(job, relation)
    if job.status in Job.FINISHED or row is None:
        return None
    if not job_lifecycle.job_claim(job=job, stage="listing files"):
        return None
    return job, row


def model_download_run(
    *, job_id: int, hf_token: str | None = None, commit: str | None = None, on_progress: ProgressCallback | None = None
) -> Model | None:
    """The task body; returns the ready model, or None when the job had already ended."""

    def files(model: Model, info: Any) -> list[tuple[str, int]]:
        if model.format == Model.Format.GGUF:  # the chosen quantization's file(s) only
            return gguf_quants(sibling_files(info)).get(gguf_quant(model.gguf_file) or "", [])
        return select_model_files(sibling_files(info), trust_remote_code=remote_code_enabled(model.trust_remote_code))

    def describe_at(model: Model, target: Path) -> tuple[Path, dict[str, Any]]:
        if model.format == Model.Format.GGUF:
            return target / model.gguf_file, describe.describe_gguf_file(target / model.gguf_file)
        return target, describe.describe_transformers_dir(target, model.quantization)

    return _download_run(
        job_id=job_id,
        relation="model",
        target_of=model_target_dir,
        files_of=files,
        describe_at=describe_at,
        hf_token=hf_token,
        commit=commit,
        on_progress=on_progress,
    )


def _download_run(
    *,
    job_id: int,
    relation: str,
    target_of: Callable[[Any], Path],
    files_of: Callable[[Any, Any], list[tuple[str, int]]],
    describe_at: Callable[[Any, Path], tuple[Path, dict[str, Any]]],
    hf_token: str | None,
    commit: str | None,
    on_progress: ProgressCallback | None,
) -> Model | SAE | None:
    """One download, model or SAE: claim the job, fetch the chosen files of the repository
    at the revision, describe what arrived, and record it on the row (or record the failure
    and leave no files)."""
    claimed = _claim_download(job_id, relation)
    if claimed is None:
        return None
    job, row = claimed
    repo_id = row.repo_id if relation == "model" else row.repository_id
    target = target_of(row)
    # recorded before any file is written: deleting the row removes this folder only
    type(row).objects.filter(pk=row.pk).update(files_dir=str(target))
    token = hub.resolve_token(hf_token)
    try:
        info = hub.model_info(repo_id=repo_id, revision=commit or row.revision, token=token)
        files = files_of(row, info)
        check_free_space(files=files, cache_dir=target.parent, repo_id=repo_id)
        progress = Progress(job, sum(s for _, s in files), on_progress)
        fetch(
            repo_id=repo_id,
            files=files,
            revision=info.sha or commit or row.revision,
            target=target,
            token=token,
            progress=progress,
        )
        # huggingface_hub's bookkeeping for local_dir downloads is not part of the files
        if (target / ".cache").exists():
            services.remove_files(target / ".cache")
        path, meta = describe_at(row, target)
    except BaseException as exc:
        _download_failed(job=job, row=row, target=target, exc=exc)
        if isinstance(exc, MillmError):
            return None
        raise
    with transaction.atomic():
        type(row).objects.filter(pk=row.pk).update(
            local_path=str(path.resolve()), status=row.Status.READY, error_message="", updated_at=timezone.now(), **meta
        )
        job_lifecycle.job_finish(job=job, status=Job.Status.SUCCEEDED)
    metrics.record_download(kind=relation, outcome="succeeded")
    row.refresh_from_db()
    log.info(f"{relation}_download_finished", **{f"{relation}_id": row.pk}, bytes=meta.get("disk_size_bytes"))
    return row


def _download_failed(*, job: Job, row: Model | SAE, target: Path, exc: BaseException) -> None:
    """A failed or cancelled download leaves no files and no row that says ready."""
    kind = "model" if isinstance(row, Model) else "sae"
    cache = settings.MODEL_CACHE_DIR if kind == "model" else settings.SAE_CACHE_DIR
    cancelled = isinstance(exc, DownloadCancelled)
    message = (
        "Download cancelled" if cancelled else getattr(exc, "message", None) or f"Download failed: {type(exc).__name__}"
    )
    clean_target(target, Path(cache))
    type(row).objects.filter(pk=row.pk).update(
        status=row.Status.ERROR, error_message=message, local_path="", updated_at=timezone.now()
    )
    job.refresh_from_db()
    if job.status not in Job.FINISHED:
        job_lifecycle.job_finish(
            job=job,
            status=Job.Status.CANCELLED if cancelled else Job.Status.FAILED,
            error=message,
            code=getattr(exc, "code", "") if isinstance(getattr(exc, "code", ""), str) else "",
        )
    metrics.record_download(kind=kind, outcome="cancelled" if cancelled else "failed")
    log.warning(
        f"{kind}_download_failed",
        **{f"{kind}_id": row.pk},
        job_id=job.id,
        code=getattr(exc, "code", type(exc).__name__),
    )


def sae_download_run(
    *, job_id: int, hf_token: str | None = None, commit: str | None = None, on_progress: ProgressCallback | None = None
) -> SAE | None:
    def describe_at(sae: SAE, target: Path) -> tuple[Path, dict[str, Any]]:
        folder = sae_dir_of(sae.file_path) if sae.file_path else ""
        path = (target / folder) if folder else target
        meta = describe.describe_sae(path)
        # what the files do not say, the registration's hints do
        if not meta["trained_on_model"]:
            meta["trained_on_model"] = sae.trained_on_model
        if meta["trained_on_layer"] is None:
            meta["trained_on_layer"] = sae.trained_on_layer
        return path, meta

    return _download_run(
        job_id=job_id,
        relation="sae",
        target_of=sae_target_dir,
        files_of=lambda sae, info: select_sae_files(sibling_files(info), sae.file_path),
        describe_at=describe_at,
        hf_token=hf_token,
        commit=commit,
        on_progress=on_progress,
    )
