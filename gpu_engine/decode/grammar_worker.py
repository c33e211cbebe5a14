"""The child process that turns a ``StructuredOutput`` into an xgrammar grammar
(``gpu_engine.decode.grammar.GrammarBuilder`` runs it): one JSON request a line on stdin, one
JSON answer a line on stdout.

Why a process: converting a JSON schema to a grammar is where xgrammar spends its time
on a costly schema (``"pattern": "a{20000}"`` takes ~25 s, ``a{60000}`` minutes) and it
cannot be interrupted; a child that overruns its deadline is killed, so its CPU comes
back at once.  Run as ``python -m gpu_engine.decode.grammar_worker``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from ..api.protocol import StructuredOutput
    from .grammar import build_grammar

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            spec = StructuredOutput(**json.loads(line))
            answer = {"grammar": build_grammar(spec).serialize_json()}
        except Exception as exc:  # noqa: BLE001 - every failure is this request's answer
            answer = {
                "error": getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}",
                "reason": (getattr(exc, "details", None) or {}).get("reason", ""),
            }
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
