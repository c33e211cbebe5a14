"""Sweeps from the command line: the services behind ``POST /api/experiments/sweep``, with
the same checks and refusals.

    manage.py sweep BODY.json [--wait]          # the body as the route takes it ("-": stdin)
    manage.py sweep --list                      # every experiment, newest first
    manage.py sweep --download ID [--format jsonl|csv|parquet] [--out FILE]

The run is queued on the ``experiments`` queue (a Celery worker runs it) and the command
prints its id; with ``--wait`` the command also runs it itself, in the foreground (a run
has one runner: should a worker take it first, the command follows that one), printing
its progress and then the run; Ctrl-C cancels it. The command acts as the operator. A
refusal prints one line, ``CODE: message``, and exits 2. ``manage.py calibrate`` is the
same for ``POST /api/experiments/calibrate``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections
from rest_framework.exceptions import ValidationError

from core.api import validated
from core.auth import ANONYMOUS
from core.errors import MillmError
from experiments import exports, runner, selectors, services
from experiments.models import ExperimentRun

EXIT_REFUSED = 2
POLL_S = 0.5


def refused(code: str, message: str) -> CommandError:
    return CommandError(f"{code}: {message}", returncode=EXIT_REFUSED)


def _validation_line(exc: ValidationError) -> CommandError:
    fields = exc.detail if isinstance(exc.detail, dict) else {"body": exc.detail}
    name, errors = next(iter(fields.items()))
    first = errors[0] if isinstance(errors, list) and errors else errors
    return refused("VALIDATION_ERROR", f"{name}: {first}")


class ExperimentCommand(BaseCommand):
    """What ``sweep`` and ``calibrate`` share: read a body, start, follow, list, download."""

    kind = ExperimentRun.Kind.SWEEP
    route = "/api/experiments/sweep"

    def add_arguments(self, parser):
        parser.add_argument("body", nargs="?", help="the request body as JSON: a file, or - for stdin")
        parser.add_argument("--wait", action="store_true", help="run it here, in the foreground, to its end")
        parser.add_argument("--list", action="store_true", help="list the experiments, newest first")
        parser.add_argument("--download", metavar="ID", help="write an experiment's points as a file")
        parser.add_argument("--format", default="jsonl", choices=list(exports.FORMATS))
        parser.add_argument("--out", default=None, help="the file to write (default: stdout)")

    def handle(self, *args, body: str | None = None, **options: Any) -> None:
        try:
            if options["list"]:
                self._list()
            elif options["download"]:
                self._download(options["download"], options["format"], options["out"])
            else:
                if not body:
                    raise refused("VALIDATION_ERROR", "body: a JSON file (or - for stdin) is required")
                self._start(self._read(body), wait=options["wait"])
        except MillmError as exc:
            raise refused(exc.code, exc.message) from exc
        except ValidationError as exc:
            raise _validation_line(exc) from exc

    def _read(self, source: str) -> dict[str, Any]:
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise refused("VALIDATION_ERROR", f"body: {exc}") from None
        if not isinstance(data, dict):
            raise refused("VALIDATION_ERROR", "body: a JSON object")
        return data

    def start(self, data: dict[str, Any]) -> ExperimentRun:  # the kind's service
        from experiments.apis import SweepInput

        return services.experiment_sweep_start(principal=ANONYMOUS, data=dict(validated(SweepInput, data)))

    def _start(self, data: dict[str, Any], *, wait: bool) -> None:
        if settings.EMBEDDED:
            raise refused(
                "ENGINE_UNAVAILABLE",
                "embedded mode: the engine lives inside the `manage.py serve` process, which a separate "
                f"command cannot reach; use POST {self.route}, or run the distributed topology "
                "(REDIS_URL set), where commands reach run_engine",
            )
        run = self.start(data)
        if not wait:
            self.stdout.write(f"Queued {run.id} ({run.total} points); follow it with `manage.py sweep --list`")
            return
        run = self._run_in_foreground(run.id)
        from experiments.apis import run_out

        self.stdout.write(json.dumps(run_out(run), cls=DjangoJSONEncoder, indent=2))
        if run.status != ExperimentRun.Status.COMPLETED:
            error = run.error or {}
            raise refused(
                error.get("code") or f"EXPERIMENT_{run.status.upper()}", error.get("message") or f"run {run.status}"
            )
        self.stdout.write(self.style.SUCCESS(f"Completed {run.id}: {run.done} points"))

    def _list(self) -> None:
        runs = list(selectors.experiments_for(None))
        if not runs:
            self.stdout.write("No experiments")
            return
        for run in runs:
            line = f"{run.id}  {run.kind:<11}  {run.status:<10}  {run.done}/{run.total}"
            if run.partial:
                line += "  partial"
            if run.error:
                line += f"  {run.error.get('code')}: {run.error.get('message')}"
            self.stdout.write(line)

    def _download(self, run_id: str, fmt: str, out: str | None) -> None:
        run = selectors.experiment_get(run_id, None)
        body, _ = exports.export(run, fmt)
        if out:
            Path(out).write_bytes(body)
            self.stdout.write(f"Wrote {len(body)} bytes to {out}")
        else:
            sys.stdout.buffer.write(body)
            sys.stdout.flush()

    def _run_in_foreground(self, run_id: str) -> ExperimentRun:
        """The run on a side thread of this process, its progress printed from the row
        until it ends (a run has one runner: should a worker of the experiments queue take
        it first, this waits for that one). Ctrl-C cancels it."""
        failure: list[BaseException] = []

        def work() -> None:
            try:
                runner.experiment_run(run_id=run_id)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=work, name=f"experiment-{run_id}", daemon=True)
        thread.start()
        last = None
        try:
            while True:
                thread.join(POLL_S)
                run = ExperimentRun.objects.get(pk=run_id)
                now = (run.status, run.done, run.total)
                if now != last:
                    self.stderr.write(f"{run.id} {run.status}: {run.done}/{run.total}")
                    last = now
                if run.status in ExperimentRun.TERMINAL:
                    return run
                if failure:
                    if isinstance(failure[0], MillmError):
                        raise failure[0]
                    raise refused("INTERNAL_ERROR", f"the run stopped: {type(failure[0]).__name__}: {failure[0]}")
        except KeyboardInterrupt:
            self.stderr.write(f"Cancelling {run_id}…")
            services.experiment_cancel(run_id=run_id, principal=ANONYMOUS)
            thread.join()
            return ExperimentRun.objects.get(pk=run_id)


class Command(ExperimentCommand):
    help = "Run a steering sweep (prompts × variants × strengths), list experiments, or download one's points."
