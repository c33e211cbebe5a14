"""Maintenance services: what a (re)starting server puts right, AUTO_LOAD_MODEL, and the
cache pruning behind ``manage.py prune_cache``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core.ids import ascii_int
from registry.transfer import model_target_dir, sae_target_dir
from registry.errors import ModelNotFound
from registry.models import SAE, Attachment, Job, Model
from registry.services import remove_files

log = structlog.get_logger(__name__)


@transaction.atomic
def startup_reconcile() -> dict[str, int]:
    """Rows a previous process left mid-way are put in a state that says so.

    In embedded mode the engine lives in the web process, so after a restart its work
    died with it: jobs that were queued or running, downloads, and loads or unloads under
    way (their rows go back to ``ready``, an interrupted unload having had its effect).
    Rows that say ``loaded`` stay, with their attachments and lock: the start-up restores
    them into the new engine (``orchestration.restore``), as run_engine does, and records
    on the rows whatever it cannot restore.

    In distributed mode a web process owns none of that: jobs and downloads run on Celery
    workers that outlive it (a second web worker starting must not fail their rows), and
    a restarted run_engine restores the recorded model and attachments. Nothing changes.
    """
    now = timezone.now()
    interrupted = downloads = resident = 0
    if settings.EMBEDDED:
        interrupted = Job.objects.filter(status__in=Job.ACTIVE).update(
            status=Job.Status.FAILED, error="Interrupted by a server restart", finished_at=now, updated_at=now
        )
        downloads = Model.objects.filter(status=Model.Status.DOWNLOADING).update(
            status=Model.Status.ERROR, error_message="Download interrupted by a server restart", updated_at=now
        )
        downloads += SAE.objects.filter(status=SAE.Status.DOWNLOADING).update(
            status=SAE.Status.ERROR, error_message="Download interrupted by a server restart", updated_at=now
        )
        moving = Model.objects.filter(status__in=(Model.Status.LOADING, Model.Status.UNLOADING))
        Attachment.objects.filter(model__in=moving).delete()
        resident = moving.update(status=Model.Status.READY, locked=False, device="", dtype="", updated_at=now)
        # attachments belong to a loaded model; anything else is left over
        Attachment.objects.exclude(model__status=Model.Status.LOADED).delete()
        SAE.objects.filter(status=SAE.Status.ATTACHED, attachments__isnull=True).update(
            status=SAE.Status.READY, updated_at=now
        )
    summary = {"jobs_interrupted": interrupted, "downloads_interrupted": downloads, "models_reset": resident}
    if any(summary.values()):
        log.info("startup_reconciled", **summary)
    return summary


def model_by_name_or_id(value: str) -> Model:
    model = Model.objects.filter(Q(name=value) | Q(pk=ascii_int(value))).first()
    if model is None:
        raise ModelNotFound(f"Model {value!r} is not registered", details={"model": value})
    return model


@dataclass
class PruneReport:
    removed: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    bytes_freed: int = 0
    dry_run: bool = True


def _referenced() -> set[Path]:
    paths: set[Path] = set()
    for value in Model.objects.exclude(local_path="").values_list("local_path", flat=True):
        paths.add(Path(value).resolve())
    for value in SAE.objects.exclude(local_path="").values_list("local_path", flat=True):
        paths.add(Path(value).resolve())

    # a download in progress has no local_path yet, but its folder is spoken for
    for model in Model.objects.filter(status=Model.Status.DOWNLOADING):
        paths.add(model_target_dir(model).resolve())
    for sae in SAE.objects.filter(status=SAE.Status.DOWNLOADING):
        paths.add(sae_target_dir(sae).resolve())
    return paths


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def cache_prune(*, dry_run: bool = True) -> PruneReport:
    """Remove what no registry row references from MODEL_CACHE_DIR and SAE_CACHE_DIR.

    An entry is kept when a row's path is inside it or it is inside a row's path; so the
    folders of SAEs downloaded from one repository (``<repo>/<sae_id>/…``) are judged one
    by one, and nothing outside the two caches is ever touched.
    """
    report = PruneReport(dry_run=dry_run)
    referenced = _referenced()

    def used(path: Path) -> bool:
        resolved = path.resolve()
        return any(ref == resolved or resolved in ref.parents or ref in resolved.parents for ref in referenced)

    for root in (Path(settings.MODEL_CACHE_DIR), Path(settings.SAE_CACHE_DIR)):
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            candidates = [entry]
            if entry.is_dir() and used(entry) and entry.resolve() not in referenced:
                # a repository folder holding several SAEs: judge each child
                candidates = sorted(entry.iterdir())
            for candidate in candidates:
                if used(candidate):
                    report.kept.append(candidate)
                    continue
                report.bytes_freed += _size(candidate)
                report.removed.append(candidate)
                if not dry_run:
                    remove_files(candidate)
    if not dry_run and report.removed:
        log.info("cache_pruned", removed=len(report.removed), bytes_freed=report.bytes_freed)
    return report
