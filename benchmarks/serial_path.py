"""Serial-path decode speed of one checkout of the engine (a benchmark, not a test).

Prints one JSON line: greedy tokens/s of single requests through the serial ``Engine``
(``--runs`` of them, ``--tokens`` each, after a warm-up), optionally with a continuous-
batching engine loaded beside it and idle (``--beside-idle-batching``), or through the
batching engine itself (``--via-batching``, a batch of one).  Run it alternately against
two checkouts to compare them, e.g. the commit before batching existed:

    git worktree add /tmp/millm-before 75bd460
    for r in 1 2 3; do
      .venv/bin/python benchmarks/serial_path.py --repo /tmp/millm-before
      .venv/bin/python benchmarks/serial_path.py
      .venv/bin/python benchmarks/serial_path.py --beside-idle-batching
      .venv/bin/python benchmarks/serial_path.py --via-batching
      .venv/bin/python benchmarks/serial_path.py --via-batching --concurrent 16
    done

``--no-pack`` measures the same with PyTorch's default CPU kernels instead of the
prepacked oneDNN weights (``MILLM_ENGINE_PACK_WEIGHTS=false``).

Each variant runs in its own process with the engine's worker as the only thread doing
torch work: with GNU OpenMP a second thread that runs torch ops gets its own thread team,
and once teams outnumber the cores libgomp throttles their spin-waiting — every op of the
later thread then runs ~1.8× slower (measured here: 30 ms vs 55 ms per SmolLM2 step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from benchmarks.prompts import story_prompt  # noqa: E402  (the measured --repo goes before it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=HERE, help="checkout whose gpu_engine is measured")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--beside-idle-batching", action="store_true")
    ap.add_argument("--via-batching", action="store_true")
    ap.add_argument(
        "--no-pack", action="store_true", help="keep PyTorch's default CPU kernels (MILLM_ENGINE_PACK_WEIGHTS=false)"
    )
    ap.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="with --via-batching: submit this many requests at once (throughput of all)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))

    from gpu_engine.runtime.engine import Engine
    from gpu_engine.api.protocol import GenerationJob, LoadModelJob, SamplingParams

    root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or HERE / ".cache" / "test-assets")
    load = LoadModelJob(args.model, str(root / "models" / args.model), dtype="float32", device="cpu")
    if args.no_pack:  # a checkout from before packing existed has no such field
        load = LoadModelJob(args.model, load.path, dtype="float32", device="cpu", options={"pack_cpu_weights": False})
    extra = None
    if args.via_batching or args.beside_idle_batching:
        from gpu_engine.api.protocol import BatchingOptions

        extra = Engine(batching=BatchingOptions(enabled=True))
        extra.load_model(load)
    engine = extra if args.via_batching else Engine()
    if engine is not extra:
        engine.load_model(load)
    job = GenerationJob(
        "s",
        prompt="Write a short story about a lighthouse keeper who finds a message in a bottle.",
        sampling=SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True),
    )
    engine.generate_sync(job, timeout_s=600)  # warm-up
    n = args.concurrent if args.via_batching else 1
    batch = (
        [
            GenerationJob(
                f"s{i}",
                prompt=story_prompt(i),
                sampling=job.sampling,
            )
            for i in range(n)
        ]
        if n > 1
        else [job]
    )
    rates = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        streams = [engine.generate(j) for j in batch]
        tokens = sum(s.result(timeout_s=600).usage.completion_tokens for s in streams)
        rates.append(tokens / (time.perf_counter() - t0))
    label = (
        (
            f"via_batching_x{n}"
            if args.via_batching
            else "beside_idle_batching"
            if args.beside_idle_batching
            else "serial"
        )
        + ("" if args.repo.resolve() == HERE else f"@{args.repo}")
        + ("_unpacked" if args.no_pack else "")
    )
    print(
        json.dumps(
            {
                "variant": label,
                "median_tok_s": statistics.median(rates),
                "best_tok_s": max(rates),
                "samples": rates,
                "load": os.getloadavg()[0],
            }
        )
    )
    os._exit(0)


if __name__ == "__main__":
    main()
