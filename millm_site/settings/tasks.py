"""Celery: Redis broker in distributed mode; in embedded mode tasks run on an in-process
thread pool (core.jobs) so a download never blocks a request.

Results are ignored but for the tasks that say otherwise: the analyses (queue
``analysis``, ``monitoring.tasks``), whose caller waits for their numbers, keep theirs in
Redis (the result backend) until read, at most CELERY_RESULT_EXPIRES."""

from .core import CONFIG, EMBEDDED

CELERY_BROKER_URL = CONFIG.REDIS_URL or "memory://"
CELERY_RESULT_BACKEND = CONFIG.REDIS_URL or None
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_DEFAULT_QUEUE = "maintenance"
# core.jobs.enqueue names the queue of every task; these routes say the same for a
# task sent any other way. "loads" is consumed where the engine is reachable.
CELERY_TASK_ROUTES = {
    "orchestration.tasks.model_load_task": {"queue": "loads"},
    "orchestration.tasks.model_unload_task": {"queue": "loads"},
    "orchestration.tasks.*": {"queue": "maintenance"},
    "registry.tasks.*": {"queue": "downloads"},
    "batches.tasks.*": {"queue": "batches"},
    "inference.tasks.*": {"queue": "responses"},
    "features.tasks.*": {"queue": "dashboards"},
    "experiments.tasks.*": {"queue": "experiments"},
    "monitoring.tasks.*": {"queue": "analysis"},
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_TIME_LIMIT = int(CONFIG.DOWNLOAD_TIMEOUT) + 60
CELERY_TASK_SOFT_TIME_LIMIT = int(CONFIG.DOWNLOAD_TIMEOUT)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
MILLM_TASKS_IN_PROCESS = EMBEDDED
