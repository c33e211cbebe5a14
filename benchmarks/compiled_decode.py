"""Compiled against eager decoding, and the static against the dynamic KV cache, on the
serial transformers backend (a benchmark, not a test): batch-1 greedy decode of the same
prompt with 8 features steered, after a warm-up (the compiled engine compiles during its
warm-up; that time is reported apart).  Each mode runs in a process of its own (one
engine, one OpenMP thread team: ``one_team.py``), ``--rounds`` requests in a row; the
modes take turns, in a rotated order, ``--passes`` times.

  eager      the default load: eager, dynamic cache (oneDNN-packed weights on the CPU)
  static     eager, KV_CACHE_MODE=static
  compiled   TORCH_COMPILE=true (the static cache; on the CPU inductor freezes and packs
             the weights itself)

Prints tokens/s (median over rounds), compiled ÷ eager, static ÷ eager (dynamic), whether
each mode's tokens equal eager's, and the graphs compiled.

    .venv/bin/python benchmarks/compiled_decode.py --model smollm2-135m --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_decode import PROMPT, asset_root, bench_sae  # noqa: E402
from benchmarks.one_team import in_processes, passing  # noqa: E402
from gpu_engine.runtime.engine import Engine  # noqa: E402
from gpu_engine.api.protocol import (  # noqa: E402
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    SteeringSpec,
)
from offline_assets import ensure_assets  # noqa: E402

MODES = {"eager": {}, "static": {"kv_cache_mode": "static"}, "compiled": {"torch_compile": True}}


def one(path: Path, name: str, mode: str, *, tokens: int, rounds: int, device: str) -> dict:
    """One mode's engine in this process: the first request (compiling, for ``compiled``)
    timed apart, then ``rounds`` requests."""
    eng = Engine()
    try:
        eng.load_model(LoadModelJob(name, str(path), dtype="float32", device=device, options=MODES[mode]))
        backend = eng.backend
        layer = backend.num_layers // 2
        sae = passing(lambda: bench_sae(name, backend.hidden_size, 1024, layer))
        eng.attach(AttachSpec("bench", str(sae), layer))
        steering = SteeringSpec.from_mapping({("bench", layer): {i * 97: 4.0 for i in range(8)}})

        def timed() -> tuple[float, list[int]]:
            job = GenerationJob(
                "bench",
                prompt=PROMPT,
                steering=steering,
                sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            )
            t0 = time.perf_counter()
            res = eng.generate_sync(job, timeout_s=3600)
            assert res.steering_apply_count[0].count == res.forward_passes == tokens
            return tokens / (time.perf_counter() - t0), res.token_ids

        t0 = time.perf_counter()
        timed()
        warmup = time.perf_counter() - t0
        samples, ids = [], []
        for _ in range(rounds):
            tps, ids = timed()
            samples.append(tps)
        status = backend.capabilities().torch_compile_status or {}
        return {"samples": samples, "warmup_s": warmup, "token_ids": ids, "compiles": status.get("compiles")}
    finally:
        eng.shutdown()


def run(path: Path, name: str, *, tokens: int, rounds: int, device: str, passes: int = 2) -> dict:
    runs = in_processes(
        Path(__file__),
        list(MODES),
        ["--model", str(path), "--tokens", str(tokens), "--rounds", str(rounds), "--device", device],
        passes=passes,
    )
    samples = {m: [x for r in runs[m] for x in r["samples"]] for m in MODES}
    warmup = {m: runs[m][0]["warmup_s"] for m in MODES}
    ids = {m: runs[m][-1]["token_ids"] for m in MODES}
    med = {m: statistics.median(v) for m, v in samples.items()}
    return {
        "model": name,
        "dtype": "float32",
        "device": device,
        "tokens": tokens,
        "rounds": rounds,
        "passes": passes,
        "tok_s": med,
        "samples": samples,
        "warmup_s": warmup,
        "compiled_vs_eager": med["compiled"] / med["eager"],
        "static_vs_dynamic": med["static"] / med["eager"],
        "tokens_equal_eager": {m: ids[m] == ids["eager"] for m in MODES},
        "compiles": runs["compiled"][-1]["compiles"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="asset name or a checkpoint directory")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--passes", type=int, default=2, help="times each mode's process runs")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--one", choices=tuple(MODES), help=argparse.SUPPRESS)  # a child's mode
    args = ap.parse_args()
    if Path(args.model).is_dir():
        path, name = Path(args.model), Path(args.model).name
    else:
        manifest = passing(lambda: ensure_assets(asset_root(), include_demo="smollm" in args.model))
        path, name = manifest.models[args.model].path, args.model
    if args.one:
        print(json.dumps(one(path, name, args.one, tokens=args.tokens, rounds=args.rounds, device=args.device)))
        return
    r = run(path, name, tokens=args.tokens, rounds=args.rounds, device=args.device, passes=args.passes)
    print(
        f"{name} float32 {r['device']}, batch 1, {r['tokens']} tokens, steering 8 features, "
        f"{r['passes']} passes of {r['rounds']} requests per mode, one process each"
    )
    for m in MODES:
        print(
            f"  {m:<9} {r['tok_s'][m]:8.1f} tok/s  first request {r['warmup_s'][m]:7.1f} s  "
            f"tokens equal eager: {r['tokens_equal_eager'][m]}"
        )
    print(
        f"  compiled ÷ eager {r['compiled_vs_eager']:.3f}, "
        f"static ÷ dynamic {r['static_vs_dynamic']:.3f}, graphs compiled {r['compiles']}"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
