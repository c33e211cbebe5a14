"""The ``dashboards`` group of ``benchmarks/run.py``: ``dashboards.py`` once per backend
(transformers, vLLM and llama.cpp where installed), each in a process of its own; the
row per backend is a dashboard run's corpus tokens per second ÷ a plain batched forward
over the same contexts (max_tokens=1, no monitor, the same rows at once), issue 34's
target ≥ 0.8."""

from __future__ import annotations

from benchmarks.harness import Ctx, Row, target

GROUP = "dashboards"
BACKENDS = ("transformers", "vllm", "llamacpp")


def group_dashboards(ctx: Ctx, missing: dict[str, str | None]) -> list[Row]:
    rows: list[Row] = []
    for backend in BACKENDS:
        what = f"{backend}: feature dashboard run ÷ plain batched forward, corpus tokens/s"
        if missing.get(backend):
            rows.append(Row(GROUP, what, status="not installed", note=f"needs {missing[backend]}"))
            continue
        argv = ["--backend", backend, "--rounds", str(ctx.rounds)]
        if ctx.quick:
            argv += ["--budget", "256", "--rows", "2"]
        r = ctx.script(GROUP, "dashboards.py", argv)
        t = r.get("timing_s") or {}
        split = ", ".join(f"{k} {v:.2f} s" for k, v in t.items())
        rows.append(
            Row(
                GROUP,
                f"{what} ({r['model']} {r['dtype']}, {r['tokens']} tokens, {r['rows']} rows)",
                r["dashboard_over_plain"],
                note=f"{r['dashboard_tok_s']:.0f} ÷ {r['plain_tok_s']:.0f} tok/s" + (f"; {split}" if split else ""),
                **target(">=", 0.8, "issue 34"),
            )
        )
        if r.get("pass_over_plain") is not None:
            rows.append(
                Row(
                    GROUP,
                    f"{backend}: the run's corpus pass alone (engine + accumulating) ÷ plain batched forward",
                    r["pass_over_plain"],
                    note=f"the run's other {r['fixed_s']:.1f} s (corpus, logit effects, finish, store) left out",
                )
            )
    return rows


__all__ = ["group_dashboards"]
