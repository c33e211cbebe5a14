"""The background-response runner as a Celery task (queue ``responses``). A worker of that
queue resumes background responses when it starts and runs the sweeper (batches/tasks.py,
batches/sweeper.py, which also sweeps stored responses).

``acks_late`` with ``reject_on_worker_lost`` (``core.jobs.long_run_task``), as the batch
runner: a run whose worker child is killed goes back in the queue, and the next runner
takes it over once the dead one's heartbeat is stale (BATCH_RUNNER_STALE_S)."""

from __future__ import annotations

from core.jobs import long_run_task
from inference.responses_runner import response_run

WINDOW_S = 3600  # a background response is one generation: an hour is more than any


@long_run_task("inference.tasks.response_run_task", limit_s=WINDOW_S, grace_s=60)
def response_run_task(response_id: str, force: bool = False) -> str:
    return response_run(response_id=response_id, force=force)
