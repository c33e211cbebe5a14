"""Moving a repository's files onto disk: where a download's files go (one folder per
row under MODEL_CACHE_DIR / SAE_CACHE_DIR), whether they fit (507 INSUFFICIENT_STORAGE),
and fetching them one by one with huggingface_hub (``hf_hub_download``: resume after a
dropped connection, revisions, tokens, the endpoint) while the bytes and percent are
recorded on the job row and cancel (``Job.cancel_requested``) and DOWNLOAD_TIMEOUT are
checked on every write.

The two halves of a download that use it are ``registry.downloads`` (the request:
free space before the row exists) and ``registry.download_run`` (the task).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings

from registry import hub, job_lifecycle, services
from registry.errors import DownloadCancelled, DownloadTimedOut, InsufficientStorage
from registry.models import SAE, Job, Model

PROGRESS_INTERVAL_S = 0.25

ProgressCallback = Callable[[int, int | None], None]


def _slug(repo_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", repo_id.replace("/", "--"))


# --- progress ----------------------------------------------------------------------------


class Progress:
    """Bytes of a whole download, written to the job row (throttled) and checked against
    cancel and the deadline on every write."""

    def __init__(self, job: Job, total: int, on_progress: ProgressCallback | None) -> None:
        self.job = job
        self.total = total or None
        self.finished_bytes = 0
        self.current = 0
        self.filename = ""
        self.deadline = time.monotonic() + float(settings.DOWNLOAD_TIMEOUT)
        self.on_progress = on_progress
        self._last_write = 0.0
        self._lock = threading.Lock()

    @property
    def done(self) -> int:
        return self.finished_bytes + max(0, self.current)

    def percent(self) -> int:
        if not self.total:
            return 0
        # 100 only when the job succeeds; a finished last file still has its check to go
        return min(99, int(self.done * 100 / self.total))

    def start_file(self, filename: str) -> None:
        self.filename = filename
        self.current = 0
        self.check()
        self.write(force=True)

    def finish_file(self, size_on_disk: int) -> None:
        self.finished_bytes += size_on_disk
        self.current = 0
        self.write(force=True)

    def advance(self, n: float) -> None:
        with self._lock:
            self.current += int(n)
        self.write()

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < PROGRESS_INTERVAL_S:
            return
        self._last_write = now
        job_lifecycle.job_progress(
            job=self.job,
            progress=self.percent(),
            stage=f"downloading {self.filename}"[:100],
            bytes_done=self.done,
            bytes_total=self.total,
        )
        if self.on_progress is not None:
            self.on_progress(self.done, self.total)
        self.check()

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise DownloadTimedOut(
                f"The download took longer than DOWNLOAD_TIMEOUT ({settings.DOWNLOAD_TIMEOUT:g} s)",
                details={"job_id": self.job.id, "timeout_s": settings.DOWNLOAD_TIMEOUT},
            )
        if Job.objects.filter(pk=self.job.pk, cancel_requested=True).exists():
            raise DownloadCancelled("The download was cancelled", details={"job_id": self.job.id})


class _Bar:
    """What huggingface_hub's ``tqdm_class`` needs (constructor, update, context manager),
    feeding ``Progress``. Negative updates happen when a resumed transfer restarts."""

    def __init__(self, progress: Progress, **kwargs: Any) -> None:
        self.progress = progress
        self.n = int(kwargs.get("initial") or 0)
        if self.n:
            progress.advance(self.n)

    def update(self, n: float = 1) -> None:
        self.n += int(n)
        self.progress.advance(n)

    def close(self) -> None:
        return None

    def __enter__(self) -> _Bar:  # noqa: PYI034 - a plain class, not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fetch(
    *, repo_id: str, files: list[tuple[str, int]], revision: str, target: Path, token: str | bool, progress: Progress
) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name, _ in files:
        progress.start_file(name)
        path = hub.download_file(
            repo_id=repo_id,
            filename=name,
            revision=revision,
            local_dir=target,
            token=token,
            tqdm_class=partial(_Bar, progress),
        )
        progress.finish_file(path.stat().st_size)


def check_free_space(*, files: list[tuple[str, int]], cache_dir: str | Path, repo_id: str) -> None:
    """Refuse (507 INSUFFICIENT_STORAGE) a download whose files, by the hub's sizes, do
    not fit in the free space of the disk that holds ``cache_dir``: asked before the row,
    the job or any file exists, and again by the task before it fetches."""
    needed = sum(size for _, size in files)
    probe = Path(cache_dir).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the cache is made by the download; its disk is its parent's
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise InsufficientStorage(
            f"Downloading {repo_id} needs {needed} bytes ({needed / 2**30:.2f} GiB) and the "
            f"disk of {cache_dir} has {free} bytes ({free / 2**30:.2f} GiB) free",
            details={"repo_id": repo_id, "needed_bytes": needed, "free_bytes": free, "directory": str(cache_dir)},
        )


def clean_target(target: Path, root: Path) -> None:
    if target.exists() and services._is_under(target, root):
        services.remove_files(target)


def model_target_dir(model: Model) -> Path:
    return Path(settings.MODEL_CACHE_DIR) / f"{_slug(model.repo_id)}--m{model.id}"


def sae_target_dir(sae: SAE) -> Path:
    return Path(settings.SAE_CACHE_DIR) / _slug(sae.repository_id) / sae.id
