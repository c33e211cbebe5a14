"""``manage.py worker -Q <queues>``: a Celery worker whose concurrency comes from the
settings, as the embedded pools' does (``core.jobs.pool_size``): ``downloads`` at
MAX_DOWNLOAD_WORKERS, ``loads`` at MAX_LOAD_WORKERS, ``responses`` at
RESPONSES_BACKGROUND_WORKERS, ``dashboards`` at DASHBOARD_WORKERS, ``experiments`` at
EXPERIMENT_WORKERS. The deploy files (compose, k8s, systemd) start their download and load
workers with it, so those settings hold in every topology.

A worker serves one limited queue, optionally with ``maintenance`` (short tasks that take
a slot of its pool, as they do in the download worker): two limited queues in one worker
would let each run at the other's limit, so that is refused (``loads`` with ``downloads``
would run loads at MAX_DOWNLOAD_WORKERS). The command replaces itself with Celery (exec),
so signals reach Celery as they would with ``celery worker`` itself."""

from __future__ import annotations

import os
import sys

from django.core.management.base import BaseCommand, CommandError

from core.jobs import QUEUES, pool_size

# queues whose tasks ride on the slots of the worker's limited queue
SHARED = ("maintenance",)


def worker_concurrency(queues: list[str]) -> int:
    """The Celery concurrency of a worker consuming ``queues`` (see the module)."""
    unknown = [q for q in queues if q not in QUEUES]
    if unknown or not queues:
        raise CommandError(f"unknown queue(s) {', '.join(unknown) or '(none)'}; known: {', '.join(QUEUES)}")
    limited = [q for q in queues if q not in SHARED]
    if len(limited) > 1:
        raise CommandError(
            f"one worker serves one limited queue (plus {', '.join(SHARED)}): run {' and '.join(limited)} "
            "in workers of their own, each at its setting's concurrency"
        )
    return pool_size(limited[0] if limited else queues[0])


def celery_argv(queues: list[str], *, name: str | None, loglevel: str) -> list[str]:
    argv = [sys.executable, "-m", "celery", "-A", "millm_site", "worker", "-Q", ",".join(queues)]
    if name:
        argv += ["-n", name]
    return argv + ["--pool=prefork", f"--concurrency={worker_concurrency(queues)}", f"--loglevel={loglevel}"]


class Command(BaseCommand):
    help = "Run a Celery worker for the given queues at the concurrency their settings give."

    def add_arguments(self, parser):
        parser.add_argument("-Q", "--queues", required=True, help="comma-separated queues, e.g. downloads,maintenance")
        parser.add_argument("-n", "--hostname", default=None, help="the worker's node name (celery -n)")
        parser.add_argument("--loglevel", default="INFO")
        parser.add_argument(
            "--print", action="store_true", dest="dry_run", help="print the Celery command instead of running it"
        )

    def handle(self, *args, queues: str, hostname: str | None, loglevel: str, dry_run: bool, **options):
        argv = celery_argv([q.strip() for q in queues.split(",") if q.strip()], name=hostname, loglevel=loglevel)
        if dry_run:
            self.stdout.write(" ".join(argv[1:]))
            return
        sys.stdout.flush()
        os.execv(argv[0], argv)
