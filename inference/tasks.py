"""The background-response runner as a Celery task (queue ``responses``). A worker of that
queue resumes background responses when it starts and runs the sweeper (batches/tasks.py,
batches/sweeper.py, which also sweeps stored responses).

``acks_late`` with ``reject_on_worker_lost``, as the batch runner: a run whose worker
child is killed goes back in the queue, and the next runner takes it over once the dead
one's heartbeat is stale (BATCH_RUNNER_STALE_S)."""

from __future__ import annotations

from celery import shared_task

from inference.responses_runner import response_run

WINDOW_S = 3600  # a background response is one generation: an hour is more than any


@shared_task(
    name="inference.tasks.response_run_task",
    acks_late=True,
    reject_on_worker_lost=True,
    soft_time_limit=WINDOW_S,
    time_limit=WINDOW_S + 60,
)
def response_run_task(response_id: str, force: bool = False) -> str:
    return response_run(response_id=response_id, force=force)
