"""The ``dashboards`` group of ``benchmarks/run.py``: ``dashboards.py`` once per backend
(transformers, vLLM and llama.cpp where installed), each in a process of its own; the
rows per backend are a dashboard run's corpus tokens per second ÷ a plain batched
forward over the same contexts (max_tokens=1, no monitor, the same rows at once), issue
34's target ≥ 0.8, over the sample's 8192 tokens (``--rounds`` rounds) and over a
65,536-token corpus built from the sample (``LARGE_ROUNDS`` rounds: a realistic size,
where the run's fixed seconds weigh less), each with the corpus pass alone."""

from __future__ import annotations

from benchmarks.harness import Ctx, Row, target

GROUP = "dashboards"
BACKENDS = ("transformers", "vllm", "llamacpp")
LARGE_BUDGET = 65536
LARGE_ROUNDS = 1  # a round over 64k tokens is minutes on a 2-core CPU (llama.cpp: ~8)


def group_dashboards(ctx: Ctx, missing: dict[str, str | None]) -> list[Row]:
    rows: list[Row] = []
    for backend in BACKENDS:
        what = f"{backend}: feature dashboard run ÷ plain batched forward, corpus tokens/s"
        if missing.get(backend):
            rows.append(Row(GROUP, what, status="not installed", note=f"needs {missing[backend]}"))
            continue
        argv = ["--backend", backend, "--rounds", str(ctx.rounds)]
        if ctx.quick:
            argv += ["--budget", "256", "--rows", "2", "--large-budget", "512"]
        else:
            argv += ["--large-budget", str(LARGE_BUDGET), "--large-rounds", str(LARGE_ROUNDS)]
        r = ctx.script(GROUP, "dashboards.py", argv)
        for f in (r, r.get("large")):
            if not f:
                continue
            t = f.get("timing_s") or {}
            split = ", ".join(f"{k} {v:.2f} s" for k, v in t.items())
            corpus = "sample" if f.get("corpus", "sample") == "sample" else "corpus built from the sample"
            rows.append(
                Row(
                    GROUP,
                    f"{what} ({r['model']} {r['dtype']}, {f['tokens']} tokens ({corpus}), {r['rows']} rows, "
                    f"{f['rounds']} round(s))",
                    f["dashboard_over_plain"],
                    note=f"{f['dashboard_tok_s']:.0f} ÷ {f['plain_tok_s']:.0f} tok/s" + (f"; {split}" if split else ""),
                    **target(">=", 0.8, "issue 34"),
                )
            )
            if f.get("pass_over_plain") is not None:
                rows.append(
                    Row(
                        GROUP,
                        f"{backend}: the run's corpus pass alone (engine + accumulating) ÷ plain batched forward, "
                        f"{f['tokens']} tokens",
                        f["pass_over_plain"],
                        note=f"the run's other {f['fixed_s']:.1f} s (corpus, logit effects, finish, store) left out",
                    )
                )
    return rows


__all__ = ["group_dashboards"]
