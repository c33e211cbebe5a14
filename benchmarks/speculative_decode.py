"""Speculative decoding against plain decoding on the serial transformers backend (a
benchmark, not a test): batch-1 greedy decode of the same prompt, unsteered and with 8
features steered, for each draft given (``self:layers=N`` or a checkpoint directory).
Each mode (plain, and each draft) runs in a process of its own — one engine, one OpenMP
thread team (``one_team.py``) — a warm-up then ``--rounds`` requests unsteered and as many
steered; the modes take turns ``--passes`` times in a rotated order.  Prints tokens/s
(median over the requests), the ratio to plain, the acceptance rate, and whether the
tokens equal plain decoding's exactly.

    .venv/bin/python benchmarks/speculative_decode.py --model smollm2-135m \\
        --draft self:layers=8 --draft self:layers=15 --tokens 64 --rounds 3
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


def _engine(path: Path, name: str, draft: str | None, k: int) -> Engine:
    options = {"speculative_model": draft, "speculative_num_tokens": k} if draft else {}
    eng = Engine()
    eng.load_model(LoadModelJob(name, str(path), dtype="float32", device="cpu", options=options))
    return eng


def one(path: Path, name: str, mode: str, *, k: int, tokens: int, rounds: int) -> dict:
    """One mode's engine in this process ("plain" or a draft): per steering, a warm-up then
    ``rounds`` timed requests."""
    eng = _engine(path, name, None if mode == "plain" else mode, k)
    try:
        backend = eng.backend
        layer = backend.num_layers // 2
        sae = passing(lambda: bench_sae(name, backend.hidden_size, 1024, layer))
        eng.attach(AttachSpec("bench", str(sae), layer))
        steering = SteeringSpec.from_mapping({("bench", layer): {i * 97: 4.0 for i in range(8)}})

        def timed(steered: bool) -> tuple[float, list[int], object]:
            job = GenerationJob(
                "bench",
                prompt=PROMPT,
                steering=steering if steered else None,
                sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            )
            t0 = time.perf_counter()
            res = eng.generate_sync(job, timeout_s=900)
            return tokens / (time.perf_counter() - t0), res.token_ids, res.speculative

        out = {}
        for steered in (False, True):
            timed(steered)  # warm-up
            samples, ids, spec = [], [], None
            for _ in range(rounds):
                tps, ids, spec = timed(steered)
                samples.append(tps)
            out["steered" if steered else "unsteered"] = {
                "samples": samples,
                "token_ids": ids,
                "acceptance_rate": getattr(spec, "acceptance_rate", None),
            }
        return out
    finally:
        eng.shutdown()


def run(path: Path, name: str, drafts: list[str], *, k: int, tokens: int, rounds: int, passes: int = 2) -> dict:
    modes = ["plain", *drafts]
    runs = in_processes(
        Path(__file__),
        modes,
        ["--model", str(path), "--num-tokens", str(k), "--tokens", str(tokens), "--rounds", str(rounds)],
        passes=passes,
    )
    out: dict = {
        "model": name,
        "dtype": "float32",
        "tokens": tokens,
        "rounds": rounds,
        "passes": passes,
        "num_tokens": k,
        "modes": {},
    }
    for label in ("unsteered", "steered"):
        med = {m: statistics.median(x for r in runs[m] for x in r[label]["samples"]) for m in modes}
        ids = {m: runs[m][-1][label]["token_ids"] for m in modes}
        out["modes"][label] = {
            m: {
                "tok_s": med[m],
                "ratio_to_plain": med[m] / med["plain"],
                "tokens_equal_plain": all(r[label]["token_ids"] == ids["plain"] for r in runs[m]),
                "acceptance_rate": runs[m][-1][label]["acceptance_rate"],
            }
            for m in modes
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", action="append", default=[])
    ap.add_argument("--num-tokens", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2, help="times each mode's process runs")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: this mode's engine only
    args = ap.parse_args()
    if args.one:
        path = Path(args.model)
        print(json.dumps(one(path, path.name, args.one, k=args.num_tokens, tokens=args.tokens, rounds=args.rounds)))
        return
    manifest = passing(lambda: ensure_assets(asset_root(), include_demo=args.model == "smollm2-135m"))
    path = manifest.models[args.model].path
    n_layers = manifest.models[args.model].num_layers
    drafts = args.draft or [f"self:layers={max(1, n_layers // 4)}", f"self:layers={max(1, n_layers // 2)}"]
    result = run(
        path, args.model, drafts, k=args.num_tokens, tokens=args.tokens, rounds=args.rounds, passes=args.passes
    )
    for label, modes in result["modes"].items():
        for m, r in modes.items():
            acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
            print(
                f"{label:9s} {m:18s} {r['tok_s']:7.2f} tok/s  x{r['ratio_to_plain']:.3f}  acceptance {acc}  "
                f"tokens equal plain: {r['tokens_equal_plain']}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    else:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
