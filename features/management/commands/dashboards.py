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
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections
from rest_framework.exceptions import ValidationError

from core.api import validated
from core.auth import ANONYMOUS
from core.errors import MillmError
from features import runner, selectors, services
from features.apis import DashboardStartInput, run_out
from features.models import DashboardRun
from registry import selectors as registry_selectors

EXIT_REFUSED = 2
POLL_S = 0.5


def refused(code: str, message: str) -> CommandError:
    return CommandError(f"{code}: {message}", returncode=EXIT_REFUSED)


def _validation_line(exc: ValidationError) -> CommandError:
    fields = exc.detail if isinstance(exc.detail, dict) else {"arguments": exc.detail}
    name, errors = next(iter(fields.items()))
    first = errors[0] if isinstance(errors, list) and errors else errors
    return refused("VALIDATION_ERROR", f"{name}: {first}")


class Command(BaseCommand):
    help = "Build feature dashboards for an SAE over a corpus (or list its runs with --list)."

    def add_arguments(self, parser):
        parser.add_argument("sae_id", help="the attached SAE (sae_…)")
        parser.add_argument("--list", action="store_true", help="list the SAE's dashboard runs, newest first")
        corpus = parser.add_mutually_exclusive_group()
        corpus.add_argument("--sample", action="store_true", help="the built-in offline sample corpus (default)")
        corpus.add_argument("--file-id", default=None, help="a /v1/files upload: JSONL rows, the text in --text-field")
        parser.add_argument("--text-field", default="text", help="the JSONL rows' text field (default text)")
        parser.add_argument("--budget", type=int, default=None, help="corpus tokens to read (≤ DASHBOARD_MAX_TOKENS)")
        parser.add_argument("--context-tokens", type=int, default=64)
        parser.add_argument("--top-k", type=int, default=10, help="top contexts kept per feature")
        parser.add_argument("--window", type=int, default=8, help="tokens kept each side of a context's max")
        parser.add_argument("--layer", type=int, default=None, help="the attachment's layer (default: the one)")
        parser.add_argument("--wait", action="store_true", help="run it here, in the foreground, to its end")

    def handle(self, *args, sae_id: str, **options: Any) -> None:
        try:
            if options["list"]:
                self._list(sae_id)
            else:
                self._start(sae_id, options)
        except MillmError as exc:
            raise refused(exc.code, exc.message) from exc
        except ValidationError as exc:
            raise _validation_line(exc) from exc

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
            if run.complete:
                line += "  complete"
            if run.error:
                line += f"  {run.error.get('code')}: {run.error.get('message')}"
            self.stdout.write(line)

    def _start(self, sae_id: str, options: dict[str, Any]) -> None:
        if options["budget"] is None:
            raise refused("VALIDATION_ERROR", "token_budget: --budget N is required")
        body: dict[str, Any] = {
            "corpus": "file" if options["file_id"] else "sample",
            "token_budget": options["budget"],
            "context_tokens": options["context_tokens"],
            "top_k": options["top_k"],
            "window": options["window"],
            "layer": options["layer"],
            "text_field": options["text_field"],
        }
        if options["file_id"]:
            body["file_id"] = options["file_id"]
        data = validated(DashboardStartInput, body)
        if settings.EMBEDDED:
            raise refused(
                "ENGINE_UNAVAILABLE",
                "embedded mode: the engine lives inside the `manage.py serve` process, which a separate "
                f"command cannot reach; use POST /api/saes/{sae_id}/dashboards, or run the distributed "
                "topology (REDIS_URL set), where commands reach run_engine",
            )
        run = services.dashboard_start(
            sae_id=sae_id,
            principal=ANONYMOUS,
            corpus=data["corpus"],
            file_id=data.get("file_id"),
            text_field=data["text_field"],
            token_budget=data["token_budget"],
            context_tokens=data["context_tokens"],
            top_k=data["top_k"],
            window=data["window"],
            layer=data["layer"],
        )
        if not options["wait"]:
            self.stdout.write(
                f"Queued {run.id} (layer {run.layer}); follow it with `manage.py dashboards --list {sae_id}`"
            )
            return
        run = self._run_in_foreground(run.id)
        if run.status != DashboardRun.Status.COMPLETED:
            error = run.error or {}
            raise refused(
                error.get("code") or f"DASHBOARD_{run.status.upper()}", error.get("message") or f"run {run.status}"
            )
        self.stdout.write(json.dumps(run_out(run), cls=DjangoJSONEncoder, indent=2))
        self.stdout.write(self.style.SUCCESS(f"Completed {run.id}: {run.tokens_done} tokens"))

    def _run_in_foreground(self, run_id: str) -> DashboardRun:
        """The run on a side thread of this process, its progress printed from the row
        here until it ends. The run is queued as well: a run has one runner at a time
        (``services.dashboard_take_over``), so should a worker of the dashboards queue take
        it first, this waits for that worker instead. Ctrl-C cancels the run."""
        failure: list[BaseException] = []

        def work() -> None:
            try:
                runner.dashboard_run(run_id=run_id)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failure.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=work, name=f"dashboard-{run_id}", daemon=True)
        thread.start()
        last = None
        try:
            while True:
                thread.join(POLL_S)
                run, last = self._progress(run_id, last)
                if run.status in DashboardRun.TERMINAL:
                    break
                if failure:
                    if isinstance(failure[0], MillmError):
                        raise failure[0]
                    raise refused("INTERNAL_ERROR", f"the run stopped: {type(failure[0]).__name__}: {failure[0]}")
        except KeyboardInterrupt:
            self.stderr.write(f"Cancelling {run_id}…")
            services.dashboard_cancel(run_id=run_id, principal=ANONYMOUS)
            thread.join()
            run, last = self._progress(run_id, last)
        return run

    def _progress(self, run_id: str, last: tuple | None) -> tuple[DashboardRun, tuple]:
        run = DashboardRun.objects.get(pk=run_id)
        now = (run.status, run.contexts_done, run.contexts_total, run.tokens_done)
        if now != last:
            self.stderr.write(
                f"{run.id} {run.status}: {run.contexts_done}/{run.contexts_total} contexts, {run.tokens_done} tokens"
            )
        return run, now
