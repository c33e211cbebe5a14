"""The ``sweeps`` group of ``benchmarks/run.py``: ``sweeps.py`` once per backend
(transformers, vLLM and llama.cpp where installed; ``--quick``: transformers on the tiny
model only), each in a process of its own. Per backend two rows from the same run: a
sweep of P prompts × S strengths through ``POST /api/experiments/sweep`` ÷ the same P×S
generations sent as concurrent /v1 requests to the same batching server (issue 35's
target ≥ 0.8), and ÷ the same points sent one at a time (target ≥ 5), in points per
second, medians over the rounds."""

from __future__ import annotations

from benchmarks.harness import Ctx, Row, target

GROUP = "sweeps"
BACKENDS = ("transformers", "vllm", "llamacpp")


def group_sweeps(ctx: Ctx, missing: dict[str, str | None]) -> list[Row]:
    rows: list[Row] = []
    for backend in BACKENDS:
        what = f"{backend}: sweep of P prompts × S strengths ÷ the same points as"
        if missing.get(backend):
            rows.append(Row(GROUP, f"{what} /v1 requests", status="not installed", note=f"needs {missing[backend]}"))
            continue
        if ctx.quick and backend != "transformers":
            rows.append(Row(GROUP, f"{what} /v1 requests", status="not measured", note="--quick: transformers only"))
            continue
        argv = ["--backend", backend, "--rounds", str(ctx.rounds)]
        if ctx.quick:
            argv += ["--model", ctx.model, "--prompts", "2", "--strengths", "2", "--max-tokens", str(ctx.tokens)]
            argv += ["--rows", "4"]
        r = ctx.script(GROUP, "sweeps.py", argv)
        grid = (
            f"{r['model']} {r['dtype']}, {r['prompts']} prompts × {len(r['strengths'])} strengths, "
            f"{r['max_tokens']} tokens, {r['rows']} rows, {r['rounds']} round(s)"
        )
        pps = r["points_per_s"]
        equal = f"; texts equal {r['texts_equal']}/{r['points']}"
        rows.append(
            Row(
                GROUP,
                f"{what} concurrent /v1 requests, points/s ({grid})",
                r["sweep_over_concurrent"],
                note=f"{pps['sweep']:.2f} ÷ {pps['concurrent']:.2f} points/s{equal}",
                **target(">=", 0.8, "issue 35"),
            )
        )
        rows.append(
            Row(
                GROUP,
                f"{what} /v1 requests one at a time, points/s ({grid})",
                r["sweep_over_sequential"],
                note=f"{pps['sweep']:.2f} ÷ {pps['sequential']:.2f} points/s",
                **target(">=", 5, "issue 35"),
            )
        )
    return rows


__all__ = ["group_sweeps"]
