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
    done
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=HERE, help="checkout whose gpu_engine is measured")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--beside-idle-batching", action="store_true")
    ap.add_argument("--via-batching", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))

    from gpu_engine.engine import Engine
    from gpu_engine.protocol import GenerationJob, LoadModelJob, SamplingParams

    root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or HERE / ".cache" / "test-assets")
    load = LoadModelJob(args.model, str(root / "models" / args.model), dtype="float32", device="cpu")
    extra = None
    if args.via_batching or args.beside_idle_batching:
        from gpu_engine.protocol import BatchingOptions

        extra = Engine(batching=BatchingOptions(enabled=True))
        extra.load_model(load)
    engine = extra if args.via_batching else Engine()
    if engine is not extra:
        engine.load_model(load)
    job = GenerationJob("s", prompt="Write a short story about a lighthouse keeper who finds a message in a bottle.",
                        sampling=SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    engine.generate_sync(job, timeout_s=600)  # warm-up
    rates = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        out = engine.generate_sync(job, timeout_s=600)
        rates.append(out.usage.completion_tokens / (time.perf_counter() - t0))
    label = ("via_batching" if args.via_batching else "beside_idle_batching" if args.beside_idle_batching
             else "serial") + ("" if args.repo.resolve() == HERE else f"@{args.repo}")
    print(json.dumps({"variant": label, "median_tok_s": statistics.median(rates), "best_tok_s": max(rates),
                      "samples": rates, "load": os.getloadavg()[0]}))
    os._exit(0)


if __name__ == "__main__":
    main()
