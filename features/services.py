"""Mutations of the feature dashboards (docs/features.md, "How a dashboard run works").

``dashboard_start`` checks what a run needs before anything is queued — the SAE exists and
is attached (409 ``SAE_NOT_ATTACHED`` naming the layers it is attached at), the budget
fits DASHBOARD_MAX_TOKENS (422 naming ``token_budget``), a file corpus is the caller's (404
naming ``file_id``) and is text (400 ``INVALID_CORPUS`` naming the field) — and queues the
run on the ``dashboards`` queue once the row is committed.

A run has one runner at a time (``RUNS``, ``core.jobs.LongRuns``: a runner whose
heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead and the next one resumes
from the run's last checkpoint); every write of a running run names its runner and is refused to any other.
Its results are stored by ``dashboard_store`` in one transaction that also sets
``complete``; a cancelled or failed run stores none.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction

from audit.services import audited
from core.auth import Principal
from core.errors import ValidationFailed
from core.events import OWNER_FIELD, publish
from core.jobs import LongRuns, Progress
from core.json_fields import has_nul
from features.accumulate import paused_gc
from features.errors import DashboardNotCancellable, DashboardSAENotAttached, InvalidCorpus
from features.models import DashboardRun, FeatureDashboard
from features.selectors import dashboard_get
from registry.engines import addressing_sae
from registry.models import SAE
from registry.selectors import sae_get

log = structlog.get_logger(__name__)

QUEUE = "dashboards"
TASK = "features.tasks.dashboard_run_task"
PROGRESS_EVERY_S = 0.5  # dashboard:progress while a run reads its corpus, at most this often

# the FeatureDashboard fields an accumulator row fills
_ROW_FIELDS = (
    "index",
    "count",
    "density",
    "mean",
    "max",
    "histogram",
    "top_contexts",
    "quantile_samples",
    "logit_top",
    "logit_bottom",
    "search_tokens",
)


NUL_SHOWN = "\u2400"  # a token's NUL character as stored: PostgreSQL text and jsonb refuse U+0000


_SCALARS = frozenset({int, float, bool, type(None)})


def storable(value: Any) -> Any:
    """``value`` with every NUL character of its strings shown as U+2400 (a byte-level
    vocabulary has a token for it; PostgreSQL's text and jsonb cannot hold it). A list of
    plain numbers, or of strings without NUL, is checked at C speed (a dashboard holds
    about a million activations and token ids)."""
    if isinstance(value, str):
        return value.replace("\x00", NUL_SHOWN) if "\x00" in value else value
    if isinstance(value, dict):
        return {k: v if type(v) in _SCALARS else storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        kinds = set(map(type, value))
        if kinds <= _SCALARS or (kinds == {str} and "\x00" not in "".join(value)):
            return list(value)
        return [storable(v) for v in value]
    return value


def _storable_windows(windows: Any) -> Any:
    """A row's token windows (``top_contexts``, or one band's ``contexts``) as
    :func:`storable` leaves them, checking each window's token texts in one C-speed join
    (their only strings; every other field is a number or a list of numbers); anything
    else goes through :func:`storable`."""
    try:
        if all(
            type(w) is dict and set(map(type, w["tokens"])) <= {str} and "\x00" not in "".join(w["tokens"])
            for w in windows
        ) and all(
            type(v) in _SCALARS or set(map(type, v)) <= _SCALARS for w in windows for k, v in w.items() if k != "tokens"
        ):
            return windows
    except (TypeError, KeyError):
        pass
    return storable(windows)


def storable_row(row: dict[str, Any]) -> dict[str, Any]:
    """A feature's dashboard row as :func:`storable` leaves it, its windows checked
    quickly (:func:`_storable_windows`)."""
    out: dict[str, Any] = {}
    for key in _ROW_FIELDS:
        if key not in row:
            continue
        value = row[key]
        if key == "top_contexts":
            value = _storable_windows(value)
        elif key == "quantile_samples" and type(value) is list and all(type(b) is dict for b in value):
            value = [{k: _storable_windows(v) if k == "contexts" else storable(v) for k, v in b.items()} for b in value]
        else:
            value = storable(value)
        out[key] = value
    return out


def _row_fields(row: dict[str, Any]) -> dict[str, Any]:
    """A feature's row as stored: its fields as they are when no string in them holds a
    NUL (one C-speed check, ``core.json_fields.has_nul``; the accumulator's texts are
    already cleaned), else as :func:`storable_row` cleans them."""
    fields = {key: row[key] for key in _ROW_FIELDS if key in row}
    return storable_row(fields) if has_nul(fields) else fields


def workdir(run_id: str) -> Path:
    """Where the run keeps its contexts, accumulator and checkpoints (DASHBOARD_DIR/<id>)."""
    return Path(settings.DASHBOARD_DIR) / run_id


def remove_workdir(run_id: str) -> None:
    shutil.rmtree(workdir(run_id), ignore_errors=True)


def attached_layer(*, sae_id: str, layer: int | None, attachments: list[Any]) -> Any:
    """The engine's attachment of ``sae_id`` (at ``layer``, or its only one), else 409
    ``SAE_NOT_ATTACHED`` naming the layers it is attached at."""
    mine = [a for a in attachments if a.sae_id == sae_id]
    layers = sorted(a.layer for a in mine)
    if layer is not None:
        match = [a for a in mine if a.layer == layer]
        if not match:
            where = f"attached at layer(s) {layers}" if layers else "not attached"
            raise DashboardSAENotAttached(
                f"SAE {sae_id} is not attached at layer {layer} ({where}); attach it there first",
                details={"param": "layer", "sae_id": sae_id, "layer": layer, "layers": layers},
            )
        return match[0]
    if not mine:
        raise DashboardSAENotAttached(
            f"SAE {sae_id} is not attached; attach it to the resident model first",
            details={"param": "sae_id", "sae_id": sae_id, "layers": []},
        )
    if len(mine) > 1:
        raise ValidationFailed(
            f"SAE {sae_id} is attached at layers {layers}; name one with layer",
            details={"param": "layer", "fields": {"layer": [f"one of {layers}"]}, "layers": layers},
        )
    return mine[0]


def check_corpus_file(*, file_id: str, text_field: str, principal: Principal) -> None:
    """The file is the caller's (404 naming file_id) and holds text (400 INVALID_CORPUS
    naming the field): a dashboard run's corpus, a fidelity run's."""
    from batches.selectors import file_content, file_get
    from features.corpus import CorpusError, parse_corpus

    file_get(file_id=file_id, principal=principal)
    try:
        for _ in parse_corpus(file_content(file_id=file_id, principal=principal), text_field=text_field):
            pass
    except CorpusError as exc:
        raise corpus_error(exc, default_param="file_id") from None


def corpus_texts(*, corpus: str, file_id: str, text_field: str, owner: str) -> Iterator[str]:
    """A run's corpus documents: the offline sample, or the owner's /v1 file (checked at
    the run's start) read as its owner, a chunk at a time."""
    from features.corpus import parse_corpus, sample_texts

    if corpus != DashboardRun.Corpus.FILE:
        yield from sample_texts()
        return
    from batches.selectors import file_content

    reader = Principal(owner=owner, label=owner, admin=True)
    yield from parse_corpus(file_content(file_id=file_id, principal=reader), text_field=text_field)


def corpus_error(exc: Exception, *, default_param: str = "file_id") -> InvalidCorpus:
    param = getattr(exc, "param", None) or default_param
    return InvalidCorpus(
        getattr(exc, "message", None) or str(exc),
        details={"param": param, "reason": getattr(exc, "code", "invalid_corpus")},
    )


def _run_target(kwargs: dict[str, Any], run: DashboardRun | None) -> tuple[str, Any, str]:
    if run is not None:
        return ("dashboard_run", run.id, run.sae_id)
    return ("dashboard_run", kwargs.get("run_id", ""), kwargs.get("sae_id", ""))


@audited(
    "dashboard.start",
    _run_target,
    # (a key naming "token" is never kept: the budget goes by another name)
    params=lambda kw: {
        **{k: kw[k] for k in ("sae_id", "corpus", "file_id", "top_k", "window", "layer") if k in kw},
        "budget": kw.get("token_budget"),
        "context": kw.get("context_tokens"),
    },
)
def dashboard_start(
    *,
    sae_id: str,
    principal: Principal,
    corpus: str = DashboardRun.Corpus.SAMPLE,
    file_id: str | None = None,
    text_field: str = "text",
    token_budget: int,
    context_tokens: int = 64,
    top_k: int = 10,
    window: int = 8,
    layer: int | None = None,
) -> DashboardRun:
    """Check and queue a run (``queued``; the ``dashboards`` queue runs it)."""
    from core.runtime import runtime

    sae = sae_get(sae_id=sae_id)
    limit = int(settings.DASHBOARD_MAX_TOKENS)
    if not 1 <= int(token_budget) <= limit:
        raise ValidationFailed(
            f"token_budget must be between 1 and {limit} (DASHBOARD_MAX_TOKENS); got {token_budget}",
            details={"param": "token_budget", "fields": {"token_budget": [f"at most {limit}"]}},
        )
    if sae.format == SAE.Format.VECTOR:
        raise ValidationFailed(
            f"{sae.id} is a steering vector: it has no features to build dashboards for",
            details={"param": "sae_id", "fields": {"sae_id": ["a steering vector has no features"]}},
        )
    if corpus not in DashboardRun.Corpus.values:
        raise ValidationFailed(
            f"corpus must be one of {list(DashboardRun.Corpus.values)}",
            details={"param": "corpus", "fields": {"corpus": ["unknown corpus"]}},
        )
    with addressing_sae(sae.id):  # the engine holding the SAE's model (registry.engines)
        status = runtime().engine.status()
    attachment = attached_layer(sae_id=sae.id, layer=layer, attachments=list(status.attachments))
    if corpus == DashboardRun.Corpus.FILE:
        if not file_id:
            raise ValidationFailed(
                "file_id is required with corpus file",
                details={"param": "file_id", "fields": {"file_id": ["required"]}},
            )
        check_corpus_file(file_id=file_id, text_field=text_field, principal=principal)
    with transaction.atomic():
        run = DashboardRun.objects.create(
            sae=sae,
            layer=attachment.layer,
            owner=principal.owner,
            corpus=corpus,
            corpus_file_id=(file_id or "") if corpus == DashboardRun.Corpus.FILE else "",
            text_field=text_field or "text",
            token_budget=int(token_budget),
            context_tokens=int(context_tokens),
            top_k=int(top_k),
            window=int(window),
        )
        RUNS.enqueue(run.id)
    log.info("dashboard_queued", run_id=run.id, sae_id=sae.id, layer=run.layer, budget=run.token_budget)
    dashboard_progress(run=run, force=True)
    return run


@audited("dashboard.cancel", _run_target)
def dashboard_cancel(*, run_id: str, principal: Principal) -> DashboardRun:
    """``cancelling``: the runner stops reading the corpus, cancels its contexts at the
    engine and ends the run ``cancelled`` with no dashboards stored; a run no live runner
    holds (queued, or its runner dead) ends ``cancelled`` at once. 409 once it ended."""
    dashboard_get(run_id, principal)  # 404 for another owner's
    return RUNS.cancel(run_id, not_cancellable=DashboardNotCancellable)


# --------------------------------------------------------------------------- a running run


def dashboard_take_over(*, run_id: str, runner: str, force: bool = False) -> tuple[str, DashboardRun | None]:
    """Become the run's runner: ``RUNS.take_over`` (a run taken over more than
    BATCH_MAX_RESUMES times ends ``failed`` with DASHBOARD_RUNNER_FAILED, nothing stored)."""
    return RUNS.take_over(run_id=run_id, runner=runner, force=force)


def dashboard_heartbeat(*, run_id: str, runner: str) -> str | None:
    """The run's status, or None when this runner no longer holds it."""
    return RUNS.heartbeat(run_id=run_id, runner=runner)


def dashboard_advance(
    *,
    run_id: str,
    runner: str,
    contexts_done: int,
    tokens_done: int,
    contexts_total: int | None = None,
    checkpoint_path: str | None = None,
    force: bool = False,
) -> bool:
    """Record the run's progress (and its last checkpoint); False when this runner no
    longer holds it. ``dashboard:progress`` at most every PROGRESS_EVERY_S."""
    return RUNS.advance(
        run_id=run_id,
        runner=runner,
        progress=dashboard_progress,
        force=force,
        contexts_done=contexts_done,
        tokens_done=tokens_done,
        contexts_total=contexts_total,
        checkpoint_path=checkpoint_path,
    )


def dashboard_fail(*, run_id: str, runner: str, code: str, message: str) -> bool:
    """End the run ``failed`` with ``error`` {code, message}: no dashboards stored (a
    cancel recorded first wins: ``cancelled``). False when this runner no longer holds it."""
    error = {"code": code, "message": message}
    return RUNS.finish(run_id=run_id, runner=runner, status=DashboardRun.Status.FAILED, error=error) is not None


def dashboard_cancelled(*, run_id: str, runner: str) -> bool:
    """The runner saw the cancel and stopped: ``cancelled``, no dashboards stored."""
    return RUNS.finish(run_id=run_id, runner=runner, status=DashboardRun.Status.CANCELLED) is not None


def dashboard_store(*, run_id: str, runner: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Store every feature's dashboard, the summary and ``complete=True`` in one
    transaction; the run's status after it (``completed``; ``cancelled`` when a cancel was
    recorded first: nothing stored; ``lost`` when another runner holds it)."""

    def store(run: DashboardRun) -> list[str]:
        with paused_gc():  # a million numbers in lists: see paused_gc
            FeatureDashboard.objects.bulk_create(
                [FeatureDashboard(run=run, sae_id=run.sae_id, **_row_fields(row)) for row in rows],
                batch_size=1000,
            )
        run.summary = storable(summary)
        run.complete = True
        return ["summary", "complete"]

    run = RUNS.finish(run_id=run_id, runner=runner, status=DashboardRun.Status.COMPLETED, store=store)
    if run is None:
        return "lost"
    if run.status == DashboardRun.Status.COMPLETED:
        log.info("dashboard_completed", run_id=run.id, features=len(rows), tokens=run.tokens_done)
        publish("dashboard:complete", {"run_id": run.id, "sae_id": run.sae_id, OWNER_FIELD: run.owner})
    return run.status


def _ended(run: DashboardRun) -> None:
    """Every end of a run (``RUNS``) deletes its working folder; it and a take-over
    publish the run's progress, and a failure ``dashboard:error``."""
    if run.status in DashboardRun.TERMINAL:
        remove_workdir(run.id)
    dashboard_progress(run=run, force=True)
    if run.status == DashboardRun.Status.FAILED:
        error = run.error or {}
        log.warning("dashboard_failed", run_id=run.id, **error)
        publish("dashboard:error", {"run_id": run.id, "sae_id": run.sae_id, **error, OWNER_FIELD: run.owner})


# ``dashboard:progress`` over /ws/events (ids, status and counts, never corpus text), to
# the run's owner and admin sockets only; while it runs at most every PROGRESS_EVERY_S per
# run: ``dashboard_progress(run=run)`` or ``(run_id=...)``, ``force`` to send it now
dashboard_progress = Progress(
    DashboardRun,
    "dashboard:progress",
    ("sae_id", "status", "contexts_done", "contexts_total", "tokens_done"),
    every_s=PROGRESS_EVERY_S,
)

# one runner at a time, its heartbeat, a cancel, the sweep and the resume (core.jobs);
# a run that failed or was cancelled stores nothing
RUNS = LongRuns(
    DashboardRun,
    what="dashboard",
    task=TASK,
    queue=QUEUE,
    failed_code="DASHBOARD_RUNNER_FAILED",
    label="Dashboard run",
    failed_note="; nothing was stored",
    ended=_ended,
)


def dashboards_sweep() -> dict[str, int]:
    """Every run nobody runs any more ends or goes on (the dashboards sweeper, every
    BATCH_SWEEP_INTERVAL_S in each process that runs dashboards): ``LongRuns.sweep`` —
    ``cancelling`` with no live runner ends ``cancelled``, its working folder deleted;
    ``running`` whose runner's heartbeat is older than BATCH_RUNNER_STALE_S gets a runner
    queued, which resumes from the last checkpoint."""
    return RUNS.sweep()


def dashboards_resume(*, force: bool) -> int:
    """Queue a runner for every run not ended (a start-up): ``LongRuns.resume``."""
    return RUNS.resume(force=force)
