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
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from django.core.serializers.json import DjangoJSONEncoder

from core.api import validated
from core.auth import ANONYMOUS
from core.commands import (
    engine_unavailable,
    error_suffix,
    refuse_unless_completed,
    refusals,
    refused,
    run_in_foreground,
)
from experiments import exports, runner, selectors, services
from experiments.models import ExperimentRun


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
        with refusals():
            if options["list"]:
                self._list()
            elif options["download"]:
                self._download(options["download"], options["format"], options["out"])
            else:
                if not body:
                    raise refused("VALIDATION_ERROR", "body: a JSON file (or - for stdin) is required")
                self._start(self._read(body), wait=options["wait"])

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
            raise engine_unavailable(self.route)
        run = self.start(data)
        if not wait:
            self.stdout.write(f"Queued {run.id} ({run.total} points); follow it with `manage.py sweep --list`")
            return
        run = self._run_in_foreground(run.id)
        from experiments.apis import run_out

        self.stdout.write(json.dumps(run_out(run), cls=DjangoJSONEncoder, indent=2))
        refuse_unless_completed(run, "EXPERIMENT")
        self.stdout.write(self.style.SUCCESS(f"Completed {run.id}: {run.done} points"))

    def _list(self) -> None:
        runs = list(selectors.experiments_for(None))
        if not runs:
            self.stdout.write("No experiments")
            return
        for run in runs:
            line = f"{run.id}  {run.kind:<11}  {run.status:<10}  {run.done}/{run.total}"
            self.stdout.write(line + ("  partial" if run.partial else "") + error_suffix(run))

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
        """The run here, its progress printed until it ends (``core.commands``)."""
        return run_in_foreground(
            self,
            run_id,
            model=ExperimentRun,
            work=runner.experiment_run,
            cancel=services.experiment_cancel,
            progress=lambda run: f"{run.id} {run.status}: {run.done}/{run.total}",
            name="experiment",
        )


class Command(ExperimentCommand):
    help = "Run a steering sweep (prompts × variants × strengths), list experiments, or download one's points."
