"""Corpus SAE fidelity from the command line: the services behind ``POST
/api/experiments/fidelity`` and ``GET /api/saes/{id}/fidelity``, with the same checks and
refusals (docs/experiments.md, "SAE fidelity").

    manage.py fidelity SAE_ID --budget N [--sample | --file-id ID [--text-field F]]
                       [--layer L] [--context-tokens N] [--dense-threshold X] [--wait] [--json]
    manage.py fidelity SAE_ID --show [--layer L] [--json]   # the SAE's newest complete figures
    manage.py fidelity --show RUN_ID [--json]               # one fidelity run

The run is queued on the ``experiments`` queue (a Celery worker runs it) and the command
prints its id; with ``--wait`` the command also runs it itself, in the foreground (a run
has one runner: should a worker take it first, the command follows that one), printing
its progress and then its figures; Ctrl-C cancels it. ``--show`` reads what is stored (no
engine needed). ``--json`` prints the route's answer instead of the readable lines: POST's
``{"run": …}`` when queued, ``GET /api/experiments/{id}``'s run with ``--wait`` or
``--show RUN_ID``, ``GET /api/saes/{id}/fidelity``'s answer with ``SAE_ID --show``. The
command acts as the operator (every file is its to read, every run its to see). A refusal
prints one line, ``CODE: message``, and exits 2; nothing is created.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core.api import validated
from core.auth import ANONYMOUS
from core.commands import dumps, engine_unavailable, error_suffix, refuse_unless_completed, refusals
from core.commands import refused_line as refused
from experiments import selectors
from experiments.fidelity import DENSE_THRESHOLD
from experiments.management.commands.sweep import ExperimentCommand
from experiments.models import ExperimentRun
from features.corpus_options import add_corpus_arguments, corpus_body

ROUTE = "/api/experiments/fidelity"


def _number(value: Any, digits: int = 6) -> str:
    return "null" if value is None else f"{value:.{digits}g}"


def figure_lines(result: dict[str, Any]) -> list[str]:
    """A run's figures (its ``result``, ``experiments.fidelity.fidelity_figures``) as lines."""
    lines = [
        f"  rows                {result.get('rows')} ({result.get('tokens')} tokens in {result.get('contexts')} contexts)",
        f"  L0                  {_number(result.get('l0'))}",
        f"  MSE                 {_number(result.get('mse'))}",
        f"  explained variance  {_number(result.get('explained_variance'))}",
        f"  loss clean          {_number(result.get('loss_clean'))}",
        f"  loss spliced        {_number(result.get('loss_spliced'))}",
        f"  loss zero-ablated   {_number(result.get('loss_zero'))}",
    ]
    recovered = f"  loss recovered      {_number(result.get('loss_recovered'))}"
    if result.get("loss_recovered_unavailable"):
        recovered += f"  ({result['loss_recovered_unavailable']})"
    lines.append(recovered)
    d_sae = result.get("d_sae")
    lines.append(f"  dead features       {result.get('dead_count')} of {d_sae}")
    dense = result.get("dense_threshold")
    share = f"{dense:.3g}" if isinstance(dense, int | float) else "?"
    lines.append(f"  dense features      {result.get('dense_count')} (firing on more than {share} of the rows)")
    for name in ("dead", "dense"):
        features = result.get(f"{name}_features") or []
        if 0 < len(features) <= 32:
            lines.append(f"    {name}: {', '.join(str(i) for i in features)}")
    return lines


class Command(ExperimentCommand):
    help = "Measure an attached SAE's fidelity over a corpus (L0, MSE, explained variance, loss recovered, dead and dense features), or show it."
    kind = ExperimentRun.Kind.FIDELITY
    route = ROUTE

    def add_arguments(self, parser):
        parser.add_argument("sae_id", nargs="?", help="the attached SAE (sae_…)")
        parser.add_argument(
            "--show",
            nargs="?",
            const="",
            default=None,
            metavar="RUN_ID",
            help="show a fidelity run (exp_…), or with SAE_ID the SAE's newest complete figures",
        )
        add_corpus_arguments(parser, context_help="tokens per context (default 64)")
        parser.add_argument(
            "--dense-threshold",
            type=float,
            default=DENSE_THRESHOLD,
            help=f"a feature firing on more than this share of the rows is dense (default {DENSE_THRESHOLD})",
        )
        parser.add_argument("--layer", type=int, default=None, help="the attachment's layer (default: the one)")
        parser.add_argument("--wait", action="store_true", help="run it here, in the foreground, to its end")
        parser.add_argument("--json", action="store_true", help="print the route's answer as JSON")

    def handle(self, *args, sae_id: str | None = None, **options: Any) -> None:
        with refusals(refuse=refused):
            if options["show"] is not None:
                self._show(sae_id, options["show"], options["layer"], as_json=options["json"])
            else:
                self._start_fidelity(sae_id, options)

    # ------------------------------------------------------------------ showing

    def _show(self, sae_id: str | None, run_id: str, layer: int | None, *, as_json: bool) -> None:
        from experiments.apis import run_out

        if run_id.startswith("sae_") and not sae_id:  # `--show SAE_ID`
            sae_id, run_id = run_id, ""
        if run_id:
            if sae_id:
                raise refused("VALIDATION_ERROR", "run_id: give a run id or an SAE id, not both")
            run = selectors.experiment_get(run_id, None)
            if run.kind != ExperimentRun.Kind.FIDELITY:
                raise refused("VALIDATION_ERROR", f"run_id: {run.id} is a {run.kind} run, not a fidelity run")
            if as_json:
                self.stdout.write(dumps(run_out(run)))
            else:
                self._print_run(run)
            return
        if not sae_id:
            raise refused("VALIDATION_ERROR", "sae_id: --show needs a run id (exp_…) or an SAE id (sae_…)")
        from experiments.fidelity_apis import FidelityQuery, sae_fidelity

        query = validated(FidelityQuery, {} if layer is None else {"layer": layer})
        answer = sae_fidelity(sae_id, None, query.get("layer"))
        if as_json:
            self.stdout.write(dumps(answer))
            return
        if answer["run_id"] is None:
            where = "" if layer is None else f" at layer {layer}"
            self.stdout.write(f"No complete fidelity run for {sae_id}{where}")
            return
        corpus = answer["corpus"] or {}
        source = "sample corpus" if corpus.get("corpus") != "file" else f"file {corpus.get('file_id')}"
        self.stdout.write(
            f"Fidelity of {sae_id} at layer {answer['layer']} ({answer['run_id']}, {source}, "
            f"budget {corpus.get('token_budget')}, context {corpus.get('context_tokens')}, "
            f"finished {answer['finished_at']}):"
        )
        for line in figure_lines(answer["fidelity"] or {}):
            self.stdout.write(line)

    def _print_run(self, run: ExperimentRun) -> None:
        spec = run.spec or {}
        source = "sample corpus" if spec.get("corpus") != "file" else f"file {spec.get('file_id')}"
        line = f"{run.id}  {run.status}  {run.sae_id} at layer {run.layer}  {source}  {run.done}/{run.total} groups"
        self.stdout.write(line + ("  partial" if run.partial else "") + error_suffix(run))
        result = run.result or {}
        if run.status == ExperimentRun.Status.COMPLETED and "rows" in result:
            self.stdout.write(
                f"Fidelity of {run.sae_id} at layer {run.layer} ({result.get('model')}, {result.get('backend')}):"
            )
            for text in figure_lines(result):
                self.stdout.write(text)

    # ------------------------------------------------------------------ starting

    def _start_fidelity(self, sae_id: str | None, options: dict[str, Any]) -> None:
        from experiments.apis import run_out
        from experiments.fidelity_apis import FidelityStartInput, fidelity_start
        from registry.selectors import sae_get

        if not sae_id:
            raise refused("VALIDATION_ERROR", "sae_id: the SAE to measure (sae_…) is required")
        body = corpus_body(options)
        body.update(sae_id=sae_id, layer=options["layer"], dense_threshold=options["dense_threshold"])
        data = validated(FidelityStartInput, body)
        sae_get(sae_id=sae_id)  # an unknown SAE is named whatever the topology
        if settings.EMBEDDED:
            raise engine_unavailable(ROUTE)
        run = fidelity_start(data=dict(data), who=ANONYMOUS)
        if not options["wait"]:
            if options["json"]:
                self.stdout.write(dumps({"run": run_out(run)}))
            else:
                self.stdout.write(
                    f"Queued {run.id} ({sae_id} at layer {run.layer}, {run.total} groups); "
                    f"follow it with `manage.py fidelity --show {run.id}`"
                )
            return
        run = self._run_in_foreground(run.id)
        if options["json"]:
            self.stdout.write(dumps(run_out(run)))
        else:
            self._print_run(run)
        refuse_unless_completed(run, "EXPERIMENT", refused)
        if not options["json"]:
            self.stdout.write(self.style.SUCCESS(f"Completed {run.id}: {(run.result or {}).get('tokens')} tokens"))
