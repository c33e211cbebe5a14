"""Analyses as a Celery task (queue ``analysis``): where they run in distributed mode
(``monitoring.analysis``; embedded, the web process's own pool runs them)."""

from __future__ import annotations

from typing import Any

from celery import shared_task


# acks early: a worker lost mid-analysis is not retried (its caller has stopped waiting by
# the time a redelivery would run); the result waits in the result backend to be read
@shared_task(name="monitoring.tasks.analysis_run_task", ignore_result=False, acks_late=False)
def analysis_run_task(asked: list[list[Any]], source: dict[str, str] | None,
                      strict: bool = False) -> dict[str, Any]:
    from monitoring.analysis import run_shipped

    return run_shipped(asked, source, strict=strict)
