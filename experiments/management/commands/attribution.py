"""Attribution from the command line: the service behind ``POST
/api/experiments/attribution`` (``experiments.attribution.attribution_run``), with the same
checks and refusals (docs/experiments.md, "Attribution"). Synchronous: it prints the
answer when the engine has computed it.

    manage.py attribution SAE_ID PROMPT [options]
    manage.py attribution SAE_ID --messages JSON|FILE|- [--no-generation-prompt] [options]
      options: [--layer L] [--target TEXT | --target-id ID] [--top-n N] [--ablate-top K] [--json]

The target is the token whose next-token logit is attributed: ``--target`` the text of
exactly one token (``' Paris'``: a leading space is part of it), ``--target-id`` its id,
neither the greedy next token. ``--messages`` takes a JSON array of ``{role, content}``,
given inline, as a file, or ``-`` for stdin. The readable answer lists the target, the top
features (attribution summed over positions, the ablation check beside it, the label)
and the per-position heat over the prompt; ``--json`` prints the route's answer (the
envelope's ``data``) instead. Only the transformers backend computes gradients: on
another the refusal names it. A refusal prints one line, ``CODE: message``, and exits 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from core.api import validated
from core.commands import dumps, engine_unavailable, refusals
from core.commands import refused_line as refused

ROUTE = "/api/experiments/attribution"
BAR = 24  # the heat bar's width at the largest position


def _messages(source: str) -> Any:
    """``--messages``: a JSON array inline, a file holding one, or - for stdin."""
    text = source
    if not source.lstrip().startswith("["):
        try:
            text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            raise refused("VALIDATION_ERROR", f"messages: {exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise refused("VALIDATION_ERROR", f"messages: not JSON ({exc})") from None


def _token(text: str) -> str:
    return repr(text)[1:-1] if text else "''"


def _label(label: str | None) -> str:
    return "" if not label else " ".join(label.split())


def readable(answer: dict[str, Any]) -> list[str]:
    """The answer as lines: target, top features with their ablation checks, heat."""
    tokens = answer["tokens"]
    target = answer["target"]
    lines = [
        f"{answer['model']} ({answer['backend']}), {answer['sae_id']} at layer {answer['layer']}, {len(tokens)} positions",
        f"Target {target['text']!r} (id {target['id']}, logit {target['logit']:.6g}"
        + (", the greedy next token)" if target["greedy"] else ")"),
        "",
        "Top features (attribution: activation × gradient summed over positions; "
        "ablation: the logit's change with the feature zeroed at every position):",
        f"  {'feature':>8}  {'attribution':>12}  {'ablation':>12}  {'activation':>11}  {'max at':<18}  label",
    ]
    for f in answer["features"]:
        ablation = "—" if f["ablation_delta"] is None else f"{f['ablation_delta']:.6g}"
        p = f["max_position"]
        at = f"{p} {_token(tokens[p]['text'])}" if 0 <= p < len(tokens) else str(p)
        lines.append(
            f"  {f['index']:>8}  {f['attribution']:>12.6g}  {ablation:>12}  {f['activation_sum']:>11.5g}  "
            f"{at[:18]:<18}  {_label(f['label'])}"
        )
    if not answer["features"]:
        lines.append("  (no feature fired)")
    lines += ["", "Heat over the prompt (per position: Σ|attribution|, Σ attribution, the largest features):"]
    peak = max((h["total"] for h in answer["heat"]), default=0.0)
    for h in answer["heat"]:
        p = h["position"]
        bar = "█" * (round(BAR * h["total"] / peak) if peak > 0 else 0)
        top = ", ".join(
            f"{t['index']} {t['attribution']:+.3g}" + (f" ({_label(t['label'])})" if t["label"] else "")
            for t in h["top"]
        )
        lines.append(
            f"  {p:>4}  {_token(tokens[p]['text'])[:14]:<14}  {h['total']:>10.4g}  {h['sum']:>+10.4g}  "
            f"{bar:<{BAR}}  {top}"
        )
    return lines


class Command(BaseCommand):
    help = "Attribute the next token's logit to an attached SAE's features (activation × gradient; transformers only)."

    def add_arguments(self, parser):
        from experiments.attribution_apis import AttributionInput

        defaults = AttributionInput().fields
        parser.add_argument("sae_id", help="the attached SAE (sae_…)")
        parser.add_argument("prompt", nargs="?", default=None, help="the prompt, read as a completion prompt")
        parser.add_argument(
            "--messages", default=None, help="a conversation: a JSON array of {role, content}, a file, or - for stdin"
        )
        parser.add_argument(
            "--no-generation-prompt",
            action="store_true",
            help="messages only: do not end with the assistant's header",
        )
        parser.add_argument("--layer", type=int, default=None, help="the attachment's layer (default: the one)")
        target = parser.add_mutually_exclusive_group()
        target.add_argument("--target", default=None, help="the text of exactly one token (default: the greedy one)")
        target.add_argument("--target-id", type=int, default=None, help="the target token's id")
        parser.add_argument(
            "--top-n", type=int, default=defaults["top_n"].default, help="top features listed (default %(default)s)"
        )
        parser.add_argument(
            "--ablate-top",
            type=int,
            default=defaults["ablate_top"].default,
            help="how many of the top features to check by ablation (default %(default)s)",
        )
        parser.add_argument("--json", action="store_true", help="print the route's answer as JSON")

    def handle(self, *args, sae_id: str, prompt: str | None = None, **options: Any) -> None:
        from experiments.attribution_apis import AttributionInput, attribution_answer
        from registry.selectors import sae_get

        with refusals(refuse=refused):
            body: dict[str, Any] = {
                "sae_id": sae_id,
                "layer": options["layer"],
                "top_n": options["top_n"],
                "ablate_top": options["ablate_top"],
                "target_token": options["target_id"] if options["target_id"] is not None else options["target"],
            }
            if prompt is not None:
                body["prompt"] = prompt
            if options["messages"] is not None:
                body["messages"] = _messages(options["messages"])
            if options["no_generation_prompt"]:
                body["add_generation_prompt"] = False
            data = validated(AttributionInput, body)
            sae_get(sae_id=sae_id)  # an unknown SAE is named whatever the topology
            if settings.EMBEDDED:
                raise engine_unavailable(ROUTE)
            answer = attribution_answer(data)
        if options["json"]:
            self.stdout.write(dumps(answer))
            return
        for line in readable(answer):
            self.stdout.write(line)
