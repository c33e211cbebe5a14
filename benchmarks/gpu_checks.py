"""The checks that need a GPU, in one prepared run (issue 17's CUDA items and SPEC §7's
GPU targets; a check script, not a test): a session that is lent a GPU machine runs it
there in one call and records what it prints in docs/performance.md.

It needs only what ``gpu_engine`` needs (torch, transformers, safetensors, tokenizers,
numpy, msgspec, filelock): no Django, no database, nothing from a hub.  Models are built
in-process: the tiny test models (``offline_assets``) for exactness, and a model of
Gemma-2-2B's shape with random bfloat16 weights for speed (decode speed at batch 1 does
not depend on the weights' values, only on their bytes and shapes).

Checks (each in a process of its own, so that a crash is that check's failure; each a
JSON entry with ``ok`` and what was measured; exit status 1 if one exactness check fails):

- ``compiled_serial``: eager, ``KV_CACHE_MODE=static`` and ``TORCH_COMPILE=true``
  (``TORCH_COMPILE_MODE``, default reduce-overhead: CUDA graphs) give the same greedy
  tokens with 8 features steered and top-k monitoring; the SAE is attached *after* the
  compiled engine compiled its step (an unsteered request first), and
  ``steering_apply_count`` equals the request's forward passes on every mode — steering
  survives the captured graphs or the check fails;
- ``compiled_batched``: the batching engine, compiled, runs 4 requests at once (two
  steered differently, one monitored, one plain); each one's tokens equal its own eager
  solo run and each steered one's apply count equals its forward passes;
- ``idle_release``: after ``TRANSFORMERS_IDLE_CACHE_RELEASE_S`` of idleness the engine
  releases its cached memory (``torch.cuda.memory_reserved`` falls) and reports it;
- ``decode_speed`` (skipped with ``--quick``): batch-1 greedy decode of the
  Gemma-2-2B-shaped model, the SAE attached and idle / steering / steering + monitoring,
  eager and compiled (with the graphs compiled while timed, which should be none),
  against the bandwidth limit (a device copy of a buffer the size of the weights,
  ``benchmarks/bandwidth.py``'s convention).  SPEC §7: steering on ≥ 0.5 of the limit.

Not here: the vLLM backend on CUDA (vLLM is not installed on the lent machines and its
wheel is far over what a call may carry), and the memory-fit rule on a card (it is the
web tier's, with Django; the engine side it reads is ``torch.cuda.mem_get_info``).

On the lent machine (Python 3.12 with torch and an older transformers already there; this
project's transformers, tokenizers and msgspec fetched here once by ``scripts/gpu-wheels``
into ``.whl/``, the call carrying ``.whl``):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py --json $OUT/gpu_checks.json

On a CPU (CI runs this, ``tests/foundation/test_benchmarks.py``; its figures mean nothing):

    .venv/bin/python benchmarks/gpu_checks.py --device cpu --speed-shape small --speed-tokens 4 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth, weight_bytes  # noqa: E402
from benchmarks.engine_decode import PROMPT  # noqa: E402
from gpu_engine.runtime.engine import Engine  # noqa: E402
from gpu_engine.api.protocol import (  # noqa: E402
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    GenerationResult,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)
from offline_assets import build_sae, ensure_assets  # noqa: E402

# Gemma-2-2B's shape (google/gemma-2-2b config.json): SPEC §7's GPU target names it
GEMMA2_2B = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    query_pre_attn_scalar=256,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
# the same architecture, small: what the CPU smoke run builds (``--speed-shape small``)
SMALL = {
    **GEMMA2_2B,
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
}
SHAPES = {"gemma-2-2b": GEMMA2_2B, "small": SMALL}
SPEC_GPU_TARGET = 0.5  # steering on, batch-1 decode ÷ bandwidth limit


def job(
    rid: str, *, tokens: int, steer: dict | None = None, monitor: tuple | None = None, prompt: str = PROMPT
) -> GenerationJob:
    """Greedy ``tokens`` (``ignore_eos``); ``steer`` {(sae, layer): {feature: strength}},
    ``monitor`` (sae, layer): top-8 plus features 1-4."""
    return GenerationJob(
        rid,
        prompt=prompt,
        steering=SteeringSpec.from_mapping(steer) if steer else None,
        monitor=(
            MonitorSpec([MonitorEntry(monitor[0], monitor[1], top_k=8, features=[1, 2, 3, 4])]) if monitor else None
        ),
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )


def applied(res: GenerationResult) -> int:
    return sum(c.count for c in res.steering_apply_count)


def top_values(res: GenerationResult) -> list[list[float]]:
    """Each monitored row's top-k activations, largest first (what a user reads; the values
    rather than the indices, so that two near-equal features swapping places between eager
    and compiled kernels is not a difference)."""
    return [[f.activation for f in rec.top_k] for rec in res.activations]


def same_top(a: GenerationResult, b: GenerationResult, rtol: float = 1e-3) -> bool:
    va, vb = top_values(a), top_values(b)
    return len(va) == len(vb) and all(
        len(x) == len(y) and all(abs(p - q) <= rtol * max(abs(p), abs(q), 1e-6) for p, q in zip(x, y))
        for x, y in zip(va, vb)
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load(
    name: str,
    path: Path,
    *,
    device: str,
    dtype: str,
    options: dict | None = None,
    batching: BatchingOptions | None = None,
    idle_release_s: float | None = None,
) -> Engine:
    eng = Engine(batching=batching, idle_release_s=idle_release_s)
    eng.load_model(LoadModelJob(name, str(path), dtype=dtype, device=device, options=options or {}))
    return eng


# ---------------------------------------------------------------------- exactness


def check_compiled_serial(
    model: Path, sae: Path, layer: int, *, device: str, dtype: str, mode: str, tokens: int
) -> dict:
    steer = {("chk", layer): {i * 7 % 64: 1.5 for i in range(8)}}
    runs: dict[str, Any] = {}
    results: dict[str, GenerationResult] = {}
    for name, options in (
        ("eager", {}),
        ("static", {"kv_cache_mode": "static"}),
        ("compiled", {"torch_compile": True, "torch_compile_mode": mode}),
    ):
        eng = load("chk", model, device=device, dtype=dtype, options=options)
        try:
            t0 = time.perf_counter()
            eng.generate_sync(job("warm", tokens=tokens), timeout_s=900)  # compiles, no hooks yet
            warm_s = time.perf_counter() - t0
            eng.attach(AttachSpec("chk", str(sae), layer))  # after compilation
            res = eng.generate_sync(job("steered", tokens=tokens, steer=steer, monitor=("chk", layer)), timeout_s=900)
            plain = eng.generate_sync(job("plain", tokens=tokens), timeout_s=900)
            caps = eng.backend.capabilities()
            results[name] = res
            runs[name] = {
                "tokens": res.token_ids,
                "plain_tokens": plain.token_ids,
                "applied": applied(res),
                "forward_passes": res.forward_passes,
                "top": top_values(res),
                "warm_s": round(warm_s, 2),
                "torch_compile": caps.torch_compile_status or None,
                "kv_cache_mode": caps.kv_cache_mode or None,
            }
        finally:
            eng.shutdown()
    eager = runs["eager"]
    problems = []
    if not eager["top"]:
        problems.append("the monitored request reported no activations in eager mode")
    if eager["tokens"] == eager["plain_tokens"]:
        problems.append("steering changed no token in eager mode (the check cannot see a skipped hook)")
    for name, r in runs.items():
        if r["applied"] != r["forward_passes"] or r["forward_passes"] < tokens:
            problems.append(f"{name}: steering applied {r['applied']} times in {r['forward_passes']} forward passes")
        if r["tokens"] != eager["tokens"]:
            problems.append(f"{name}: steered tokens differ from eager")
        if r["plain_tokens"] != eager["plain_tokens"]:
            problems.append(f"{name}: unsteered tokens differ from eager")
        if not same_top(results[name], results["eager"]):
            problems.append(f"{name}: monitored top-k activations differ from eager")
    return {"ok": not problems, "problems": problems, "mode": mode, "runs": runs}


def check_compiled_batched(
    model: Path, sae: Path, layer: int, *, device: str, dtype: str, mode: str, tokens: int
) -> dict:
    jobs = [
        job("a", tokens=tokens, steer={("chk", layer): {3: 6.0, 9: 4.0}}),
        job("b", tokens=tokens, steer={("chk", layer): {17: -5.0}}, prompt="The capital of France"),
        job("c", tokens=tokens, monitor=("chk", layer), prompt="Once upon a time"),
        job("d", tokens=tokens, prompt="def fibonacci(n):"),
    ]
    solo: dict[str, GenerationResult] = {}
    eng = load("chk", model, device=device, dtype=dtype)
    try:
        eng.attach(AttachSpec("chk", str(sae), layer))
        for j in jobs:
            solo[j.request_id] = eng.generate_sync(j, timeout_s=900)
    finally:
        eng.shutdown()
    eng = load(
        "chk",
        model,
        device=device,
        dtype=dtype,
        options={"torch_compile": True, "torch_compile_mode": mode},
        batching=BatchingOptions(enabled=True, max_batch_size=4),
    )
    try:
        unsteered_a = eng.generate_sync(job("warm", tokens=tokens), timeout_s=900)  # a's prompt
        eng.attach(AttachSpec("chk", str(sae), layer))
        streams = [eng.generate(j) for j in jobs]
        together = {j.request_id: s.result(900) for j, s in zip(jobs, streams)}
        compiled = eng.backend.capabilities().torch_compile_status or None
    finally:
        eng.shutdown()
    problems = []
    for rid, res in together.items():
        if res.token_ids != solo[rid].token_ids:
            problems.append(f"{rid}: tokens in the compiled batch differ from its eager solo run")
        if res.steering_apply_count and applied(res) != res.forward_passes:
            problems.append(f"{rid}: steering applied {applied(res)} times in {res.forward_passes} passes")
    if not top_values(solo["c"]) or not same_top(together["c"], solo["c"]):
        problems.append("c: monitored top-k activations differ from its eager solo run")
    if solo["a"].token_ids == unsteered_a.token_ids:
        problems.append("a's steering changed no token (the check cannot see a skipped hook)")
    return {"ok": not problems, "problems": problems, "mode": mode, "torch_compile": compiled}


IDLE_RELEASE_WAIT_S = 60.0  # the longest the idle release may be late on a busy machine


def check_idle_release(model: Path, *, device: str, dtype: str, tokens: int) -> dict:
    eng = load(
        "chk",
        model,
        device=device,
        dtype=dtype,
        idle_release_s=1.0,
        batching=BatchingOptions(enabled=True, max_batch_size=4),
    )
    try:
        streams = [eng.generate(job(f"r{i}", tokens=tokens)) for i in range(4)]
        for s in streams:
            s.result(900)
        sync(device)
        before = torch.cuda.memory_reserved() if device.startswith("cuda") else None
        cached_before = eng.memory_status().get("cached_bytes")
        # the release comes once the engine has been idle 1 s; on a loaded machine its timer
        # thread may run late, so wait for it (bounded) instead of sleeping a fixed 2 s
        deadline = time.monotonic() + IDLE_RELEASE_WAIT_S
        status = eng.memory_status()
        while status["idle_releases"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            status = eng.memory_status()
        after = torch.cuda.memory_reserved() if device.startswith("cuda") else None
    finally:
        eng.shutdown()
    problems = []
    if status["idle_releases"] < 1:
        problems.append(f"no idle release within {IDLE_RELEASE_WAIT_S:.0f} s with TRANSFORMERS_IDLE_CACHE_RELEASE_S=1")
    if before is not None and after is not None and not after < before:
        problems.append(f"torch.cuda.memory_reserved did not fall ({before} -> {after})")
    return {
        "ok": not problems,
        "problems": problems,
        "reserved_before": before,
        "reserved_after": after,
        "cached_bytes_before": cached_before,
        "status": status,
    }


# ---------------------------------------------------------------------- speed


def gemma2_shaped(out: Path, tokenizer_from: Path, *, shape: dict, device: str) -> Path:
    """A Gemma-2 checkpoint of ``shape`` with random bfloat16 weights (built on ``device``),
    with the tiny Gemma-2's tokenizer (its ids are all below the vocabulary size)."""
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    import shutil

    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # small weights: random logits, no overflow in bfloat16
        for p in model.parameters():
            p.mul_(0.02 / max(float(p.float().std()), 1e-6))
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    del model
    return out


def decode_speed(model: Path, *, device: str, mode: str, tokens: int, rounds: int) -> dict:
    wbytes = weight_bytes(model)  # bfloat16 as saved
    bw = copy_bandwidth(wbytes, device=device)
    limit = bw["gb_s"] * 1e9 / wbytes
    out: dict[str, Any] = {
        "weight_bytes": wbytes,
        "bandwidth": bw,
        "limit_tok_s": limit,
        "tokens": tokens,
        "rounds": rounds,
        "modes": {},
    }
    config = json.loads((model / "config.json").read_text())
    layer = config["num_hidden_layers"] // 2
    sae = model.parent / f"{model.name}-sae-L{layer}"
    if not (sae / "sae_weights.safetensors").exists():
        build_sae(
            sae,
            d_in=config["hidden_size"],
            d_sae=16384,
            layer=layer,
            layout="saelens",
            activation="relu",
            model_name=model.name,
        )
    for compiled in (False, True):
        options = {"torch_compile": True, "torch_compile_mode": mode} if compiled else {"torch_compile": False}
        eng = load(model.name, model, device=device, dtype="bfloat16", options=options)
        try:
            steer = {("bench", layer): {i * 97: 4.0 for i in range(8)}}
            modes = {
                "sae_idle": {},
                "steer": {"steer": steer},
                "steer_monitor": {"steer": steer, "monitor": ("bench", layer)},
            }
            t0 = time.perf_counter()
            eng.attach(AttachSpec("bench", str(sae), layer))
            for m, kw in modes.items():  # compiles; a second steered request recompiled once
                for w in range(2):
                    eng.generate_sync(job(f"warm-{m}-{w}", tokens=tokens, **kw), timeout_s=900)
            warm_s = time.perf_counter() - t0
            compiles_warm = (eng.backend.capabilities().torch_compile_status or {}).get("compiles", 0)
            samples: dict[str, list[float]] = {m: [] for m in modes}
            counts: dict[str, list[int]] = {m: [] for m in modes}
            for r in range(rounds):
                for m, kw in modes.items():
                    sync(device)
                    t0 = time.perf_counter()
                    res = eng.generate_sync(job(f"{m}-{r}", tokens=tokens, **kw), timeout_s=900)
                    sync(device)
                    samples[m].append(tokens / (time.perf_counter() - t0))
                    counts[m].append(applied(res) - res.forward_passes if "steer" in kw else 0)
            key = "compiled" if compiled else "eager"
            status = eng.backend.capabilities().torch_compile_status or None
            if status is not None:
                # graphs compiled while the timed rounds ran: anything but 0 is a recompile
                # per request, which the timings then include
                status["compiled_during_rounds"] = status["compiles"] - compiles_warm
                out[f"{key} torch_compile"] = status
            for m in modes:
                med = statistics.median(samples[m])
                out["modes"][f"{key} {m}"] = {
                    "tok_s": med,
                    "vs_limit": med / limit,
                    "samples": samples[m],
                    "warm_s": round(warm_s, 1),
                    "apply_count_minus_passes": counts[m],
                }
        finally:
            eng.shutdown()
    best = max(v["vs_limit"] for k, v in out["modes"].items() if k.endswith(" steer"))
    out["steering_vs_limit_best"] = best
    out["ok"] = best >= SPEC_GPU_TARGET and all(
        c == 0 for v in out["modes"].values() for c in v["apply_count_minus_passes"]
    )
    return out


# ---------------------------------------------------------------------- main


def environment(device: str) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(card=p.name, memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


CHECKS = ("compiled_serial", "compiled_batched", "idle_release", "decode_speed")


def run_check(name: str, args: argparse.Namespace) -> dict:
    """One check, in this process (a child's ``--one NAME``)."""
    device = args.device
    mode = args.compile_mode or ("reduce-overhead" if device.startswith("cuda") else "default")
    manifest = ensure_assets(args.assets or args.work / "assets")
    if name == "decode_speed":
        gemma = gemma2_shaped(
            args.work / f"gemma2-{args.speed_shape}-shaped",
            manifest.models["tiny-gemma2"].path,
            shape=SHAPES[args.speed_shape],
            device=device,
        )
        return decode_speed(gemma, device=device, mode=mode, tokens=args.speed_tokens, rounds=args.rounds)
    tiny, layer = manifest.models["tiny-llama"], 1
    sae = args.work / "sae-tiny"
    if not (sae / "sae_weights.safetensors").exists():
        build_sae(
            sae,
            d_in=tiny.hidden_size,
            d_sae=64,
            layer=layer,
            layout="saelens",
            activation="relu",
            model_name="tiny-llama",
        )
    if name == "idle_release":
        return check_idle_release(tiny.path, device=device, dtype="float32", tokens=args.tokens)
    check = check_compiled_serial if name == "compiled_serial" else check_compiled_batched
    return check(tiny.path, sae, layer, device=device, dtype="float32", mode=mode, tokens=args.tokens)


def in_child(name: str, argv: list[str]) -> dict:
    """``name`` in a process of its own: a crash (a segfault in a compiler, an out-of-memory
    kill) is that check's failure, with its output's tail, and the other checks still run."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--one", name], capture_output=True, text=True
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    return {
        "ok": False,
        "error": f"the check's process ended with status {proc.returncode}",
        "output_tail": (proc.stdout + proc.stderr)[-3000:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--compile-mode", default=None, help="TORCH_COMPILE_MODE (default: reduce-overhead on CUDA, default on the CPU)"
    )
    ap.add_argument("--quick", action="store_true", help="exactness checks only (no decode speed)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per exactness request")
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument(
        "--speed-shape", choices=SHAPES, default="gemma-2-2b", help="the decode_speed model (small: the CPU smoke run)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "millm-gpu-checks")
    ap.add_argument("--assets", type=Path, help="the tiny test models' folder (default: WORK/assets)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=CHECKS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one check, its JSON as the last line
        print(json.dumps(run_check(args.one, args), default=str), flush=True)
        return 0
    report: dict[str, Any] = {"environment": environment(args.device), "checks": {}}
    print(json.dumps(report["environment"]), flush=True)
    ensure_assets(args.assets or args.work / "assets")  # once, before the children read it
    argv = sys.argv[1:]
    failed = False
    for name in CHECKS[:3] if args.quick else CHECKS:
        t0 = time.perf_counter()
        res = in_child(name, argv)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        report["checks"][name] = res
        failed |= not res["ok"] and name != "decode_speed"
        status = "ok" if res["ok"] else "target missed" if "modes" in res else "FAILED"
        print(f"{name}: {status} ({res['seconds']} s) {res.get('problems') or res.get('error') or ''}", flush=True)
        if not res["ok"] and res.get("output_tail"):
            print(res["output_tail"][-1500:], flush=True)
        if name == "decode_speed" and "modes" in res:
            print(f"  limit {res['limit_tok_s']:.0f} tok/s ({res['bandwidth']['gb_s']:.0f} GB/s copy)")
            for k, v in res["modes"].items():
                print(f"  {k:<24} {v['tok_s']:8.1f} tok/s  {v['vs_limit']:.3f} of the limit")
            recompiled = (res.get("compiled torch_compile") or {}).get("compiled_during_rounds")
            if recompiled:
                print(f"  the compiled model compiled {recompiled} graphs during the timed rounds")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
