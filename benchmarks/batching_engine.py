"""Continuous batching inside the engine: throughput against the serial path and the
alternatives we could have built on (a benchmark, not a test).

Measured in one process, interleaved round by round (order rotated each round) so drift
from other load hits every mode alike; greedy, ``--tokens`` new tokens per request
(``ignore_eos``), prompts of ~20 tokens that differ per request.

  serial          the serial engine; requests run one after another (its throughput does
                  not depend on how many are queued, so ``--serial-requests`` of them are run)
  engine          the continuous-batching engine, all requests submitted at once
  engine_mixed    the same with an SAE attached and mixed per-request steering: a third
                  unsteered, the others steered with different features (8 each)
  raw_slab        our decode loop over the slab cache (``BatchKVCache``) without scheduler,
                  hooks or events: what the engine's bookkeeping costs
  raw_dynamic     the same loop over transformers' ``DynamicCache``, left-padded once and
                  grown by ``torch.cat`` every step (the layout we did not pick)
  hf_static       ``model.generate`` on a left-padded static batch (SPEC §7: 7.5× at 16, fp32)
  hf_generate_batch  transformers' continuous batching (``generate_batch`` on a persistent
                  manager, measured after the other modes; SPEC §7: 4.9×)

  engine_clamp    the ``engine`` batch with an SAE attached and every request clamping 8
                  features of its own (issue 19: target ≥ 0.95× ``engine``)
  engine_conditional  every request adding 8 features only where a trigger feature of its
                  own fires (issue 19: target ≥ 0.95× ``engine``)

  engine_capture_last  the ``engine`` batch with every request capturing the last row of
                  every layer (issue 15; target ≤ 10% cost, i.e. ≥ 0.91× ``engine``)
  engine_capture_all   the same capturing every row (prompt and completion) of every layer

  engine_capture_big   other rows' time per token while one row of the batch takes a large
                  stored capture (every row of every layer, its prompt made long enough
                  for ``--capture-mib``, 256 by default; it makes ``--big-tokens`` tokens and
                  leaves), against the same batch whose long row captures nothing (issue 38:
                  target ≤ 1.05×); the row's artifact is packed and written by the engine's
                  capture writer while the others decode.  ``engine_capture_big_on_worker``:
                  the same with the writer set aside, so the artifact is packed on the
                  engine's worker (what the writer saves the others; a lower bound on the
                  cost before issue 38, when the worker also serialised a copy with
                  safetensors' ``save`` before writing it)

``--idle`` also measures a single serial request with and without a continuous-batching
engine (its own model copy) idle in the same process, and with transformers' own
``ContinuousBatchingManager`` idle (SPEC §7: 0.94× fp32).  Usage:

    .venv/bin/python benchmarks/batching_engine.py --batch 1 --batch 4 --batch 8 --batch 16 --rounds 3 --idle
    # capture cost at 1 and 16 concurrent requests (ratios against ``engine``)
    .venv/bin/python benchmarks/batching_engine.py --batch 1 --batch 16 --rounds 3 \
        --modes engine,engine_capture_last,engine_capture_all
    # steering modes at 16 concurrent requests (ratios against ``engine``)
    .venv/bin/python benchmarks/batching_engine.py --batch 16 --rounds 3 \
        --modes engine,engine_mixed,engine_clamp,engine_conditional
    # a 256 MiB capture in one row: the other rows' time per token (4 rows, 64 tokens)
    .venv/bin/python benchmarks/batching_engine.py --batch 4 --rounds 3 --modes engine_capture_big
    # smoke: the tiny model, a few tokens
    .venv/bin/python benchmarks/batching_engine.py --model tiny-llama --batch 1 --batch 2 --rounds 1 \
        --tokens 4 --modes engine,engine_capture_last,engine_capture_all
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from benchmarks.engine_decode import bench_sae
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    CaptureSpec,
    ErrorEvent,
    FeatureControl,
    FinishEvent,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from benchmarks.prompts import story_prompt
from offline_assets import ensure_assets


def prompt(i: int) -> str:
    return story_prompt(i)


def asset_root() -> Path:
    return Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")


def steering_for(i: int, sae_id: str, layer: int) -> SteeringSpec | None:
    if i % 3 == 0:
        return None
    return SteeringSpec.from_mapping({(sae_id, layer): {(i * 131 + j * 97) % 16384: 4.0 for j in range(8)}})


def controls_for(i: int, sae_id: str, layer: int, kind: str) -> SteeringSpec:
    """8 features of request ``i``'s own: clamped (``clamp``), or added only where a
    trigger feature fires (``conditional``)."""
    feats = [(i * 131 + j * 97) % 16384 for j in range(8)]
    if kind == "clamp":
        controls = [FeatureControl(f, mode="clamp", value=4.0) for f in feats]
    else:
        trigger = (i * 577 + 11) % 16384
        controls = [FeatureControl(f, mode="add", value=4.0, condition=SteeringCondition(trigger, 0.0)) for f in feats]
    return SteeringSpec([SteeringEntry(sae_id, layer, {}, controls)])


def jobs(
    n: int,
    tokens: int,
    steer: tuple[str, int] | None = None,
    capture: CaptureSpec | None = None,
    controls: str | None = None,
) -> list[GenerationJob]:
    def steering(i: int) -> SteeringSpec | None:
        if steer is None:
            return None
        return controls_for(i, *steer, controls) if controls else steering_for(i, *steer)

    return [
        GenerationJob(
            f"b{i}",
            prompt=prompt(i),
            capture=capture,
            steering=steering(i),
            sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


def long_prompt(runner, n_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """``n_tokens`` token ids of story text (stories joined until long enough)."""
    ids: list[int] = []
    i = 0
    while len(ids) < n_tokens:
        ids += runner.encode_text(prompt(1000 + i) + "\n")
        i += 1
    return ids[:n_tokens]


def big_capture(runner, mib: float, big_tokens: int, directory: str) -> tuple[list[int], CaptureSpec, int]:  # type: ignore[no-untyped-def]
    """A prompt and a capture of every row of every layer of about ``mib`` MiB (as many
    rows as the model's context allows), always stored under ``directory``, and the
    capture's size in bytes."""
    layers = list(range(runner.num_layers))
    row_bytes = len(layers) * runner.hidden_size * runner.dtype.itemsize + 16
    rows = int(mib * 2**20) // row_bytes
    n_prompt = max(8, min(rows - big_tokens + 1, runner.context_length - big_tokens - 1))
    spec = CaptureSpec(layers=layers, positions="all", inline_max_bytes=0, directory=directory)
    return long_prompt(runner, n_prompt), spec, (n_prompt + big_tokens - 1) * row_bytes


def other_rows_tpot(engine: Engine, others: list[GenerationJob], big: GenerationJob) -> float:
    """Start ``others`` and ``big`` in one prefill (the serving tier's arrival gather), then
    the median over ``others`` of each one's time per token after its first (its decode:
    the long row's steps, its end and its capture's packing all fall inside it)."""
    stamps: dict[str, list[float]] = {j.request_id: [] for j in others}
    ended: list[Any] = []
    done = threading.Event()
    everyone = len(others) + 1

    def take(ev: Any, seen: list[float]) -> None:
        seen.append(time.perf_counter())
        if isinstance(ev, (FinishEvent, ErrorEvent)):
            ended.append(ev)
            if len(ended) == everyone:
                done.set()

    with engine.arriving():
        streams = [engine.generate(j) for j in [*others, big]]
    for stream in streams:
        seen = stamps.get(stream.request_id, [])
        stream.deliver_to(lambda ev, seen=seen: take(ev, seen))
    if not done.wait(1200):
        raise TimeoutError("the batch did not finish")
    errors = [ev for ev in ended if isinstance(ev, ErrorEvent)]
    if errors:
        raise RuntimeError(f"{errors[0].request_id}: {errors[0].code}: {errors[0].message}")
    # each list: one stamp per token event and one for the finish event
    return statistics.median((t[-2] - t[0]) / (len(t) - 2) for t in stamps.values())


def run_engine(engine: Engine, batch: list[GenerationJob]) -> float:
    t0 = time.perf_counter()
    streams = [engine.generate(j) for j in batch]
    total = sum(s.result(timeout_s=1200).usage.completion_tokens for s in streams)
    return total / (time.perf_counter() - t0)


# ---------------------------------------------------------------- raw loops


def raw_loop(runner, ids: list[list[int]], tokens: int, layout: str) -> float:
    from transformers import DynamicCache

    from gpu_engine.backends.transformers.kv_cache import BatchKVCache

    t0 = time.perf_counter()
    with torch.inference_mode():
        firsts, pasts = [], []
        for p in ids:
            logits, past = runner.prefill_full_cache(torch.tensor([p]))
            firsts.append(int(logits[-1].argmax()))
            pasts.append(past)
        nxt = firsts
        if layout == "slab":
            cache = BatchKVCache(runner.num_layers, device=runner.device, dtype=runner.dtype)
            for past in pasts:
                cache.merge(past)
            for _ in range(tokens - 1):
                cache.reserve(1)
                pos, mask = cache.step_inputs()
                logits = runner.forward_rows(
                    torch.tensor([[t] for t in nxt]), position_ids=pos, attention_mask=mask, past=cache
                )
                cache.advance(1)
                nxt = logits.argmax(-1).tolist()
        else:
            longest = max(len(p) for p in ids)
            cache = DynamicCache()
            for layer in range(runner.num_layers):
                ks, vs = [], []
                for past, p in zip(pasts, ids):
                    pad = longest - len(p)
                    ks.append(torch.nn.functional.pad(past.layers[layer].keys, (0, 0, pad, 0)))
                    vs.append(torch.nn.functional.pad(past.layers[layer].values, (0, 0, pad, 0)))
                cache.update(torch.cat(ks), torch.cat(vs), layer)
            starts = torch.tensor([longest - len(p) for p in ids])
            length = longest
            for _ in range(tokens - 1):
                pos = (length - starts).unsqueeze(1)
                mask = (torch.arange(length + 1).unsqueeze(0) >= starts.unsqueeze(1)).long()
                logits = runner.forward_rows(
                    torch.tensor([[t] for t in nxt]), position_ids=pos, attention_mask=mask, past=cache
                )
                length += 1
                nxt = logits.argmax(-1).tolist()
    return len(ids) * tokens / (time.perf_counter() - t0)


def hf_static(runner, texts: list[str], tokens: int) -> float:
    tok = runner.tokenizer
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = runner.model.generate(
            **enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    assert out.shape[1] - enc["input_ids"].shape[1] == tokens
    return len(texts) * tokens / (time.perf_counter() - t0)


def hf_generate_batch(model, ids: list[list[int]], tokens: int) -> float:
    """One ``generate_batch`` call on the model's persistent manager (creating a manager
    costs seconds to a minute here, so it is created once per batch size and reused)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch(ids, generation_config=cfg, warmup=False, persistent_manager=True)
    n = sum(len(o.generated_tokens) for o in out.values())
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serial-requests", type=int, default=3)
    ap.add_argument("--modes", default="serial,engine,engine_mixed,raw_slab,raw_dynamic,hf_static,hf_generate_batch")
    ap.add_argument("--idle", action="store_true", help="also measure the serial path beside idle batching")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--capture-mib", type=float, default=256.0, help="engine_capture_big: the capture's size")
    ap.add_argument("--big-tokens", type=int, default=4, help="engine_capture_big: tokens of the capturing row")
    args = ap.parse_args()
    batches = args.batch or [1, 4, 8, 16]
    modes = args.modes.split(",")

    manifest = ensure_assets(asset_root(), include_demo="smollm" in args.model)
    path = manifest.models[args.model].path
    load = LoadModelJob(args.model, str(path), dtype=args.dtype, device="cpu")
    serial = Engine()
    serial.load_model(load)
    batched = Engine(batching=BatchingOptions(enabled=True, max_batch_size=max(batches)))
    batched.load_model(load)
    runner = batched.backend
    layer = runner.num_layers // 2
    big_dir = tempfile.mkdtemp(prefix="millm-bench-capture-")
    big_sizes: dict[int, int] = {}
    # engine_capture_big*: the other rows' ms per token (without, with the capture) per run
    big_tpot: dict[str, dict[int, list[tuple[float, float]]]] = {}
    sae_path = bench_sae(args.model, runner.hidden_size, 16384, layer)
    hf_cb_model = None
    if "hf_generate_batch" in modes:
        from transformers import AutoModelForCausalLM

        hf_cb_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=runner.dtype).eval()

    def measure(mode: str, n: int) -> float:
        runner = batched.backend  # reloaded by the --idle phase
        ids = [runner.encode_text(prompt(i)) for i in range(n)]
        if mode == "serial":
            return run_engine(serial, jobs(min(n, args.serial_requests), args.tokens))
        if mode == "engine":
            batched.detach(None)
            return run_engine(batched, jobs(n, args.tokens))
        if mode == "engine_mixed":
            if not batched.attachments():
                batched.attach(AttachSpec("bench", str(sae_path), layer))
            return run_engine(batched, jobs(n, args.tokens, ("bench", layer)))
        if mode in ("engine_clamp", "engine_conditional"):
            if not batched.attachments():
                batched.attach(AttachSpec("bench", str(sae_path), layer))
            return run_engine(batched, jobs(n, args.tokens, ("bench", layer), controls=mode[len("engine_") :]))
        if mode.startswith("engine_capture_big"):
            batched.detach(None)
            ids, spec, size = big_capture(runner, args.capture_mib, args.big_tokens, big_dir)
            big_sizes[n] = size
            others = jobs(max(n - 1, 1), args.tokens)

            def big(capture: CaptureSpec | None) -> GenerationJob:
                return GenerationJob(
                    "big",
                    prompt_token_ids=ids,
                    capture=capture,
                    sampling=SamplingParams(max_tokens=args.big_tokens, temperature=0.0, ignore_eos=True),
                )

            plain = other_rows_tpot(batched, others, big(None))
            sched = batched._scheduler  # the benchmark's own engine: its writer set aside
            writer = sched.writer  # type: ignore[union-attr]
            if mode.endswith("_on_worker"):
                sched.writer = None  # type: ignore[union-attr]
            try:
                captured = other_rows_tpot(batched, others, big(spec))
            finally:
                sched.writer = writer  # type: ignore[union-attr]
            for f in Path(big_dir).iterdir():
                f.unlink()
            big_tpot.setdefault(mode, {}).setdefault(n, []).append((plain * 1000, captured * 1000))
            return captured / plain  # a ratio of times, not tok/s
        if mode.startswith("engine_capture_"):
            batched.detach(None)
            layers = list(range(runner.num_layers))
            return run_engine(
                batched, jobs(n, args.tokens, capture=CaptureSpec(layers=layers, positions=mode.rsplit("_", 1)[1]))
            )
        if mode.startswith("raw_"):
            return raw_loop(runner, ids, args.tokens, mode[4:])
        if mode == "hf_static":
            return hf_static(runner, [prompt(i) for i in range(n)], args.tokens)
        raise ValueError(mode)

    hf_cb = "hf_generate_batch" in modes
    modes = [m for m in modes if m != "hf_generate_batch"]  # measured in its own phase below
    for n in batches:  # warm-up: allocator, kernels, first-call overheads
        for mode in modes:
            if mode != "serial":
                measure(mode, min(n, 2))
    samples: dict[str, dict[int, list[float]]] = {m: {n: [] for n in batches} for m in modes}
    idle: dict[str, list[float]] = {"alone": [], "beside_idle_engine": [], "beside_idle_hf_manager": []}
    for r in range(args.rounds):
        for n in batches:
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                if mode == "serial" and n != batches[0]:
                    # one serial figure per round serves every batch size
                    samples["serial"][n].append(samples["serial"][batches[0]][-1])
                    continue
                samples[mode][n].append(measure(mode, n))
                unit = "× time per token" if mode.startswith("engine_capture_big") else "tok/s"
                print(f"round {r} n={n} {mode}: {samples[mode][n][-1]:.3f} {unit}", file=sys.stderr)
        if args.idle:
            one = jobs(1, args.tokens)
            batched.unload_model()
            idle["alone"].append(run_engine(serial, one))
            batched.load_model(load)  # loaded and idle: its worker blocks on its queue
            idle["beside_idle_engine"].append(run_engine(serial, one))
    if hf_cb:
        # transformers' continuous batching, after the interleaved rounds: its persistent
        # manager keeps a thread that would disturb the other modes (SPEC §7)
        samples["hf_generate_batch"] = {n: [] for n in batches}
        for n in batches:
            ids = [batched.backend.encode_text(prompt(i)) for i in range(n)]
            hf_generate_batch(hf_cb_model, ids, args.tokens)  # creates and sizes the manager
            for _ in range(args.rounds):
                samples["hf_generate_batch"][n].append(hf_generate_batch(hf_cb_model, ids, args.tokens))
                print(f"hf_generate_batch n={n}: {samples['hf_generate_batch'][n][-1]:.1f} tok/s", file=sys.stderr)
            if args.idle and n == batches[-1]:
                for _ in range(args.rounds):  # the manager is alive and has nothing to do
                    idle["beside_idle_hf_manager"].append(run_engine(serial, jobs(1, args.tokens)))
            hf_cb_model.destroy_cached_continuous_batching_manager()
        modes.append("hf_generate_batch")
    serial.shutdown()
    batched.shutdown()

    med = {m: {n: statistics.median(v) for n, v in per.items() if v} for m, per in samples.items()}
    best = {m: {n: max(v) for n, v in per.items() if v} for m, per in samples.items()}
    print(
        f"\n{args.model} dtype={args.dtype} tokens={args.tokens} rounds={args.rounds} "
        f"threads={torch.get_num_threads()}  (tok/s median | best; ratio = / serial of the same statistic)"
    )
    big_modes = [m for m in modes if m.startswith("engine_capture_big")]
    for m in big_modes:
        print(
            f"  {m}: the other rows' time per token with a {big_sizes[batches[0]] / 2**20:.1f} MiB capture in "
            "one row ÷ the same batch without it (1.00 = no cost; target ≤ 1.05): "
            + ", ".join(
                f"n={n}: median {med[m][n]:.3f}, rounds {[round(v, 3) for v in samples[m][n]]}" for n in batches
            )
        )
        print(
            "    ms per token (without, with) in each round: "
            + ", ".join(
                f"n={n}: {[(round(a, 1), round(b, 1)) for a, b in big_tpot[m][n][-args.rounds :]]}" for n in batches
            )
        )
    if [m for m in modes if m not in big_modes]:
        print(f"  {'mode':<18}" + "".join(f"{'n=' + str(n):>26}" for n in batches))
    for m in [m for m in modes if m not in big_modes]:
        cells = []
        for n in batches:
            ms, bs = med[m][n], best[m][n]
            ref = "serial" if "serial" in med else "engine"
            cells.append(f"{ms:7.1f}|{bs:6.1f} ({ms / med[ref][n]:4.2f}×|{bs / best[ref][n]:4.2f}×)")
        print(f"  {m:<18}" + "".join(f"{c:>26}" for c in cells))
    if "engine_mixed" in modes and "engine" in modes:
        print(
            "  mixed steering / unsteered batch: "
            + ", ".join(
                f"n={n}: {med['engine_mixed'][n] / med['engine'][n]:.3f} (best {best['engine_mixed'][n] / best['engine'][n]:.3f})"
                for n in batches
            )
        )
    for m in ("engine_clamp", "engine_conditional"):
        if m in modes and "engine" in modes:
            print(
                f"  {m} / unsteered batch: "
                + ", ".join(
                    f"n={n}: {med[m][n] / med['engine'][n]:.3f} (best {best[m][n] / best['engine'][n]:.3f})"
                    for n in batches
                )
            )
    capture_modes = [m for m in modes if m.startswith("engine_capture_") and m not in big_modes]
    if capture_modes and "engine" in modes:
        result_capture = {m: {n: med[m][n] / med["engine"][n] for n in batches} for m in capture_modes}
        for m, per in result_capture.items():
            print(
                f"  {m} / engine (throughput ratio; cost = 1/ratio - 1): "
                + ", ".join(f"n={n}: {r:.3f}" for n, r in per.items())
            )
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "samples": samples,
        "median": med,
        "best": best,
    }
    if capture_modes and "engine" in modes:
        result["capture_ratio"] = result_capture
    if big_modes:
        result["big_capture"] = {
            "bytes": big_sizes,
            "tpot_ratio": {m: med[m] for m in big_modes},
            # the rounds' (without, with) ms per token; warm-up runs first
            "tpot_ms": big_tpot,
        }
    if args.idle:
        im = {k: statistics.median(v) for k, v in idle.items() if v}
        print(
            "  serial single request: "
            + ", ".join(f"{k} {v:.1f} tok/s ({v / im['alone']:.3f}×)" for k, v in im.items())
        )
        result["idle"] = idle
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
