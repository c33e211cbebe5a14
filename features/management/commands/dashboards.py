"""Feature dashboards from the command line: the services behind
``POST /api/saes/{id}/dashboards``, with the same checks and refusals.

    manage.py dashboards SAE_ID [--sample | --file-id ID] --budget N [--context-tokens N]
                         [--top-k K] [--window W] [--text-field F] [--layer L] [--wait]
    manage.py dashboards --list SAE_ID

The run is queued on the ``dashboards`` queue (a Celery worker runs it) and the command
prints its id; with ``--wait`` the command also runs it itself, in the foreground (a run
has one runner: should a worker take it first, the command follows that one), printing
its progress and then the run with its corpus summary; Ctrl-C cancels it. The
command acts as the operator (every file is its to read). A refusal prints one line,
``CODE: message``, and exits 2.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from django.core.serializers.json import DjangoJSONEncoder

from core.api import validated
from core.auth import ANONYMOUS
from core.commands import engine_unavailable, error_suffix, refuse_unless_completed, refusals, run_in_foreground
from features import runner, selectors, services
from features.apis import DashboardStartInput, dashboard_start, run_out
from features.corpus_options import add_corpus_arguments, corpus_body
from features.models import DashboardRun
from registry import selectors as registry_selectors


class Command(BaseCommand):
    help = "Build feature dashboards for an SAE over a corpus (or list its runs with --list)."

    def add_arguments(self, parser):
        parser.add_argument("sae_id", help="the attached SAE (sae_…)")
        parser.add_argument("--list", action="store_true", help="list the SAE's dashboard runs, newest first")
        add_corpus_arguments(parser)
        parser.add_argument("--top-k", type=int, default=10, help="top contexts kept per feature")
        parser.add_argument("--window", type=int, default=8, help="tokens kept each side of a context's max")
        parser.add_argument("--layer", type=int, default=None, help="the attachment's layer (default: the one)")
        parser.add_argument("--wait", action="store_true", help="run it here, in the foreground, to its end")

    def handle(self, *args, sae_id: str, **options: Any) -> None:
        with refusals(whole="arguments"):
            if options["list"]:
                self._list(sae_id)
            else:
                self._start(sae_id, options)

    def _list(self, sae_id: str) -> None:
        registry_selectors.sae_get(sae_id=sae_id)
        runs = list(selectors.runs_for(sae_id))
        if not runs:
            self.stdout.write(f"No dashboard runs for {sae_id}")
            return
        for run in runs:
            done = f"{run.contexts_done}/{run.contexts_total} contexts, {run.tokens_done} tokens"
            corpus = run.corpus if run.corpus == DashboardRun.Corpus.SAMPLE else f"file {run.corpus_file_id}"
            line = f"{run.id}  {run.status:<10}  layer {run.layer}  {corpus}  budget {run.token_budget}  {done}"
            self.stdout.write(line + ("  complete" if run.complete else "") + error_suffix(run))

    def _start(self, sae_id: str, options: dict[str, Any]) -> None:
        body = corpus_body(options)
        body.update(top_k=options["top_k"], window=options["window"], layer=options["layer"])
        data = validated(DashboardStartInput, body)
        if settings.EMBEDDED:
            raise engine_unavailable(f"/api/saes/{sae_id}/dashboards")
        run = dashboard_start(sae_id, ANONYMOUS, data)
        if not options["wait"]:
            self.stdout.write(
                f"Queued {run.id} (layer {run.layer}); follow it with `manage.py dashboards --list {sae_id}`"
            )
            return
        run = self._run_in_foreground(run.id)
        refuse_unless_completed(run, "DASHBOARD")
        self.stdout.write(json.dumps(run_out(run), cls=DjangoJSONEncoder, indent=2))
        self.stdout.write(self.style.SUCCESS(f"Completed {run.id}: {run.tokens_done} tokens"))

    def _run_in_foreground(self, run_id: str) -> DashboardRun:
        """The run here, its progress printed until it ends (``core.commands``). Should a
        worker of the dashboards queue take it first (``services.dashboard_take_over``),
        this waits for that worker instead."""
        return run_in_foreground(
            self,
            run_id,
            model=DashboardRun,
            work=runner.dashboard_run,
            cancel=services.dashboard_cancel,
            progress=lambda run: (
                f"{run.id} {run.status}: {run.contexts_done}/{run.contexts_total} contexts, {run.tokens_done} tokens"
            ),
            name="dashboard",
            report_cancelled=True,
        )
