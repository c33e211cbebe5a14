"""Every ratio of SPEC §7 / issue 17 item 8 in one run: one table, JSON and PNG plots
(a benchmark, not a test).

    .venv/bin/python benchmarks/run.py                       # everything (one to two hours on 2 cores)
    .venv/bin/python benchmarks/run.py --only decode,batching
    .venv/bin/python benchmarks/run.py --quick               # smoke: tiny model, figures meaningless
    .venv/bin/python benchmarks/run.py --only decode --against OLD/results.json   # run, then compare
    .venv/bin/python benchmarks/run.py --compare-only --against A.json --against B.json  # run nothing

The measurements are the existing scripts of ``benchmarks/``, each run as a subprocess of
its own (so no two engines share a process: see serial_path.py on GNU OpenMP's second
thread team) with ``--json``; this script only reads their JSON, measures the machine's
memory bandwidth itself, and turns everything into ratios:

  bandwidth       a plain ``torch`` copy of a buffer the size of each backend's weights,
                  best of several repetitions, counted as bytes read + bytes written (the
                  STREAM convention, ``bandwidth.py``); limit in tok/s = bandwidth /
                  weight bytes (every weight read once per decoded token, batch 1)
  decode          engine_decode.py: no SAE / idle SAE / steering / steering + monitoring,
                  the engine against plain HF ``generate``, and the transformers backend
                  against the bandwidth limit
  v1_streaming    v1_streaming.py: /v1 against the engine directly (TTFT, time per token)
  v1_concurrency  v1_concurrency.py: 16 streaming /v1 clients, batched against serial
                  and mixed steering against unsteered
  batching        serial_path.py, one process per variant: the batching engine with 1, 4,
                  8, 16 concurrent requests against the serial engine
  steering_modes  batching_engine.py at 16 requests: clamp 8 features / conditional
                  steering against the unsteered batch
  capture         batching_engine.py at 1 and 16 requests: last-token / all-token capture of
                  every layer against the same batch without capture
  capture_backends  capture_backends.py: the same on the vLLM and llama.cpp backends
                  (where installed)
  llamacpp        llamacpp_decode.py (where llama-cpp-python and the GGUF are installed):
                  steering and monitoring against plain llama-cpp-python, against the
                  transformers backend and against the bandwidth limit
  vllm            vllm_backend.py (where vLLM is installed): the backend through /v1
                  against plain vLLM, against the transformers backend, and plain vLLM
                  batch 1 against the bandwidth limit
  speculative     speculative_decode.py: SPECULATIVE_MODEL self-drafts (a quarter and a
                  half of the model's blocks) against plain decoding, unsteered and
                  steered, with the acceptance rate and whether the tokens are equal
  quantized       quantized_decode.py: Q8 and Q4 loads of the transformers backend against
                  the float32 load, batch 1
  compile         compiled_decode.py: TORCH_COMPILE=true against eager, KV_CACHE_MODE=static
                  against dynamic (batch 1, steered), each with its exact-token check
  chat_turns      chat_turns.py (suite_chat_turns.py): a 10-turn chat through
                  /v1/chat/completions streaming, the conversation resent each turn, on the
                  transformers demo model and its GGUF (llama.cpp, where installed): the last
                  turn's TTFT with the prefix cache on ÷ off (PREFIX_CACHE_MAX_MB 256 / 0),
                  the cache's hit rate, and /v1/responses ÷ /v1/chat/completions streaming
                  per output token (transformers)
  dashboards      dashboards.py (suite_dashboards.py), one process per backend
                  (transformers, vLLM and llama.cpp where installed): a feature dashboard
                  run of the demo SAE over the offline sample corpus, corpus tokens/s ÷
                  a plain batched forward of the same contexts (max_tokens=1, no monitor,
                  DASHBOARD_ENGINE_ROWS at once)
  sweeps          sweeps.py (suite_sweeps.py), one process per backend (transformers,
                  vLLM and llama.cpp where installed): a sweep of P prompts × S
                  strengths of one demo SAE feature through POST /api/experiments/sweep
                  ÷ the same P×S generations as concurrent /v1 requests to the same
                  batching server (issue 35: ≥ 0.8), and ÷ the same points sent one at a
                  time (≥ 5), points per second

A group whose backend is missing prints "not installed", one that failed prints "failed"
with its log; nothing is left out of the table silently.  Written to ``--out`` (default
``.cache/benchmarks/<date>``): ``results.json`` (every row, the machine, each script's
own JSON), ``ratios.png``, the scripts' own plots, and ``logs/<group>.log``.

Every row carries the machine kind it was measured on (``machine`` in results.json, e.g.
``AMD EPYC Zen 4 (AVX-512)``: product line, microarchitecture and vector ISA from
/proc/cpuinfo, ``harness.machine_kind``), and results.json's ``machine`` block keeps the
vendor, model name, family and model, the ISA flags that matter, the logical CPUs, the
load average at the start and end, and a 512 MiB copy's bandwidth measured after the groups.

``--against FILE`` (a results.json or the folder holding it; repeatable) prints, after the
run's own table, one more: every ratio row with its target and its value per machine kind
side by side — a column per kind, or, for a kind that several files hold (this run counts
as the last file), "before" and "after" and the difference — with "—" where a file lacks
the row (``benchmarks/compare.py``). ``--compare-only`` runs no group and writes nothing:
it prints that table for the ``--against`` files alone. A file that is missing, not JSON
or not shaped as results.json stops the command before any group runs, with one line on
stderr and exit status 2.

This file is the command (its options, the groups' loop, what a group that cannot run
shows); the groups are ``benchmarks/suites.py``, their harness (rows, running a script,
the machine, the table and plot) ``benchmarks/harness.py``, and the comparison
``benchmarks/compare.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bandwidth import copy_bandwidth, measured  # noqa: E402
from benchmarks.compare import BadResults, load, table  # noqa: E402
from benchmarks.harness import Ctx, Failed, Row, machine, plot, print_table, software  # noqa: E402
from benchmarks.suites import GROUPS, RUNNERS, llamacpp_missing, vllm_missing  # noqa: E402

MISSING = {"llamacpp": llamacpp_missing, "vllm": vllm_missing}
# what each group's table rows would be, for a group that could not run
PLACEHOLDER = {
    "decode": "no SAE / idle SAE / steering / steering + monitoring",
    "v1_streaming": "/v1 against the engine directly",
    "v1_concurrency": "/v1 batched against serial",
    "batching": "batched against serial at 1, 4, 8, 16",
    "steering_modes": "clamp / conditional at 16",
    "capture": "capture cost",
    "capture_backends": "capture cost on vLLM and llama.cpp",
    "llamacpp": "llama.cpp against plain llama-cpp-python and transformers",
    "vllm": "vLLM against plain vLLM and transformers",
    "speculative": "speculative decoding against plain",
    "quantized": "Q8 / Q4 against fp32",
    "compile": "compiled against eager, static against dynamic KV cache",
    "chat_turns": "10-turn chat, prefix cache on against off",
    "dashboards": "feature dashboards against a plain batched forward",
    "sweeps": "a steering sweep against the same points as /v1 requests",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: the tiny test model, few tokens, one round (figures meaningless)",
    )
    ap.add_argument("--only", help=f"comma-separated groups out of {','.join(GROUPS)}")
    ap.add_argument("--out", type=Path, help="output folder (default .cache/benchmarks/<date>)")
    ap.add_argument("--model", help="transformers model asset (default smollm2-135m; --quick: tiny-llama)")
    ap.add_argument("--tokens", type=int, help="new tokens per request (default 64; --quick: 4)")
    ap.add_argument("--rounds", type=int, help="rounds per script (default 3; --quick: 1)")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds one script may run")
    ap.add_argument(
        "--against",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="an earlier results.json (or its folder) to compare with, per machine kind (repeatable)",
    )
    ap.add_argument("--compare-only", action="store_true", help="run no group: compare the --against files and exit")
    args = ap.parse_args()
    if args.compare_only and not args.against:
        ap.error("--compare-only needs at least one --against FILE")
    try:  # before any group runs: a bad file must not wait for the end of a long run
        earlier = [load(f) for f in args.against]
    except BadResults as e:
        print(f"benchmarks/run.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.compare_only:
        print(table(earlier))
        return
    groups = GROUPS if not args.only else tuple(g.strip() for g in args.only.split(",") if g.strip())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        ap.error(f"unknown group(s) {','.join(unknown)}; choose from {','.join(GROUPS)}")
    args.out = args.out or REPO / ".cache" / "benchmarks" / time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    ctx = Ctx(args)
    mach = machine()
    meta = software() | {
        "quick": ctx.quick,
        "model": ctx.model,
        "tokens": ctx.tokens,
        "rounds": ctx.rounds,
        "groups": list(groups),
        "groups_not_run": [g for g in GROUPS if g not in groups],
    }
    rows: list[Row] = []
    timings: dict[str, float] = {}
    for g in groups:
        t0 = time.monotonic()
        missing = MISSING.get(g, lambda: None)()
        if missing:
            rows.append(Row(g, PLACEHOLDER[g], status="not installed", note=f"needs {missing}"))
            continue
        try:
            rows += [r.judge(ctx.quick) for r in RUNNERS[g](ctx)]
        except Failed as e:
            rows.append(Row(g, PLACEHOLDER[g], status="failed", note=str(e)))
        except Exception as e:  # a script's JSON not shaped as expected: say so, keep the other groups
            rows.append(Row(g, PLACEHOLDER[g], status="failed", note=f"{type(e).__name__}: {e}"))
        timings[g] = time.monotonic() - t0
        print(f"[{g}] done in {timings[g]:.0f} s", file=sys.stderr, flush=True)
    for r in rows:
        r.machine = mach["kind"]
    mach["load_average_end"] = os.getloadavg()
    meta["group_seconds"] = timings
    print_table(rows, ctx.quick)
    if meta["groups_not_run"]:
        print(f"groups not run (--only): {', '.join(meta['groups_not_run'])}")
    bw = {str(k): v for k, v in measured().items()}  # the groups' limits, by weight bytes
    # the machine's own figure, one size for every run (a small model's weights sit in the cache)
    copy = copy_bandwidth(512 << 20, reps=5)
    mach["bandwidth"] = {k: copy[k] for k in ("buffer_bytes", "reps", "gb_s", "read_gb_s", "convention")}
    for v in [*bw.values(), copy]:
        print(
            f"bandwidth: copy of {v['buffer_bytes'] / 1e6:.0f} MB, best of {v['reps']}: {v['gb_s']:.1f} GB/s "
            f"read + written (a plain read of it: {v['read_gb_s']:.1f} GB/s)"
        )
    print(
        f"{mach['kind']}: {mach['model_name']}, {mach['cpus']} CPUs, torch {meta['torch']} "
        f"({meta['torch_threads']} threads), load average {mach['load_average_start'][0]:.1f} → "
        f"{mach['load_average_end'][0]:.1f}, commit {meta['commit']}"
    )
    result = {"meta": meta, "machine": mach, "bandwidth": bw, "rows": [asdict(r) for r in rows], "raw": ctx.raw}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    if earlier:
        print()
        print(table([*earlier, load(args.out / "results.json", label=f"this run ({args.out})")]))
    title = (
        f"miLLM benchmarks/run.py, {ctx.model}, {ctx.tokens} tokens, {mach['kind']} ({mach['cpus']} CPUs), "
        f"{meta['date']}" + ("\n--quick: FIGURES MEANINGLESS (smoke run)" if ctx.quick else "")
    )
    try:
        plot(rows, args.out / "ratios.png", title)
    except ImportError:
        print("matplotlib is not installed (requirements/dev.txt): no plot", file=sys.stderr)
    print(f"written: {args.out / 'results.json'}, {args.out / 'ratios.png'}")


if __name__ == "__main__":
    main()
