"""Analyses as a Celery task (queue ``analysis``): where they run in distributed mode
(``monitoring.analysis``; embedded, the web process's own pool runs them)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from monitoring.ownership import Scope


# acks early: a worker lost mid-analysis is not retried (its caller has stopped waiting by
# the time a redelivery would run); the result waits in the result backend to be read
@shared_task(name="monitoring.tasks.analysis_run_task", ignore_result=False, acks_late=False)
def analysis_run_task(
    asked: list[list[Any]], source: dict[str, str] | None, strict: bool = False, scope: list[Any] | None = None
) -> dict[str, Any]:
    """``scope``: ``[owner, sees_all]`` of the caller, whose stored captures an analyzer
    may read (absent: a task queued before scopes existed, which reads none but its own
    anonymous owner's)."""
    from monitoring.analysis import run_shipped

    owner, sees_all = scope if scope else ("anonymous", False)
    return run_shipped(asked, source, strict=strict, scope=Scope(owner=str(owner), all=bool(sees_all)))
