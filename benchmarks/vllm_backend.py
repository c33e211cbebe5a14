"""Plain vLLM against miLLM's vLLM backend through /v1, beside the transformers batching
backend (issue 14 item 7; a benchmark, not a test).

Three things run for the whole benchmark, one measured at a time, in alternating order so
each ratio is a pair taken under the same outside load:

- ``plain``: ``vllm.LLM`` in a worker process of its own (this script with
  ``--plain-worker``), the same model, dtype and engine arguments as the backend uses
  (eager, prefix caching, async scheduling off, ``max_num_seqs``, engine core in-process);
  N clients are N prompts handed to one ``LLM.generate`` call — vLLM's own best case, no
  HTTP, no streaming;
- ``vllm``: ``manage.py serve`` with ``MILLM_BACKEND=vllm`` (``VLLM_DISTRIBUTED_EXECUTOR=uni``),
  N concurrent streaming /v1 clients (``benchmarks/v1_concurrency.py``'s clients and
  prompts);
- ``transformers``: the same server on the transformers backend with continuous batching,
  in ``--transformers-dtype`` (float32 by default: its fast path on CPU, prepacked oneDNN
  weights; in bfloat16 on an AVX2 CPU it ran at 1.3 tok/s for one client, not a useful
  reference).

Per server and N (1, 4, 8, 16 clients, ``--tokens`` greedy tokens each, ``ignore_eos``):
``unsteered``; ``mixed`` steering (a quarter each unsteered, two inline feature sets, a
profile at intensity 0.5); ``monitored``: mixed plus ``return_sae_activations`` top-k 8 over
the completion on every request.  Throughput = completion tokens / (first request sent →
last stream closed).  Printed: every figure, and the ratios against plain vLLM (median of
the rounds' paired ratios); targets (issue 14): mixed >= 0.95x and monitored >= 0.90x
plain vLLM at 16 clients.  JSON to ``--json``, a PNG to ``--plot``.  Usage:

    .venv/bin/python benchmarks/vllm_backend.py --rounds 2 --json bench.json \\
        --plot docs/img/vllm_backend.png
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

from benchmarks.prompts import TOPICS  # noqa: E402
from benchmarks.v1_concurrency import Server, run_clients, setup_steering  # noqa: E402
from benchmarks.v1_concurrency import body as v1_body  # noqa: E402

STEERINGS = ("unsteered", "mixed", "monitored")
SERVERS = ("vllm", "transformers")
MAX_NUM_SEQS = 16
# what the backend itself passes to vLLM (gpu_engine/backends/vllm/backend.py), so plain
# vLLM runs the same engine: only the serving stack differs
ENGINE_ARGS = dict(
    enforce_eager=True,
    enable_prefix_caching=True,
    async_scheduling=False,
    max_num_seqs=MAX_NUM_SEQS,
    seed=0,
    compilation_config={"mode": 0},
)
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def prompt(i: int) -> str:
    return v1_body(i, model="", tokens=1, steering="unsteered", d_sae=1)["prompt"]


def plain_worker(model_path: str, dtype: str) -> None:
    """``--plain-worker``: one ``vllm.LLM``; each stdin line ``{"n", "tokens"}`` runs n
    prompts in one ``generate`` and answers one JSON line on stdout."""
    os.environ.update(VLLM_ENV)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, **ENGINE_ARGS)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(max_tokens=ask["tokens"], temperature=0.0, ignore_eos=True)
        prompts = [prompt(i) for i in range(ask["n"])]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"throughput": tokens / wall, "tokens": tokens, "wall": wall}), flush=True)


class Plain:
    def __init__(self, model_path: Path, dtype: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--plain-worker", str(model_path), "--dtype", dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **VLLM_ENV},
        )
        while True:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("the plain vLLM worker exited before it was ready")
            if line.startswith("{") and json.loads(line).get("ready"):
                return

    def run(self, n: int, tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"n": n, "tokens": tokens}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        while True:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("the plain vLLM worker died")
            if line.startswith("{"):
                return json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def clients_body(i: int, *, steering: str, **kw) -> dict:
    b = v1_body(i, steering="unsteered" if steering == "unsteered" else "mixed", **kw)
    if steering == "monitored":
        b["return_sae_activations"] = {"top_k": 8, "positions": "completion"}
    return b


def run_server(server: Server, n: int, steering: str, **kw) -> dict:
    return run_clients(server, n, make_body=clients_body, steering=steering, **kw)


def plot(figures: dict, clients: list[int], path: Path, title: str) -> None:
    names = [s for s in SERVERS if s in figures]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(
        clients, [figures["plain"][n] for n in clients], marker="s", color="black", label="plain vLLM (LLM.generate)"
    )
    colors = {"vllm": "tab:blue", "transformers": "tab:orange"}
    styles = {"unsteered": "-", "mixed": "--", "monitored": ":"}
    for name in names:
        for steering in STEERINGS:
            ax.plot(
                clients,
                [figures[name][steering][n]["throughput"] for n in clients],
                marker="o",
                color=colors[name],
                linestyle=styles[steering],
                label=f"/v1 {name} backend, {steering}",
            )
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("throughput (completion tok/s, median of rounds)")
    ax.set_xticks(clients)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transformers-dtype", default="float32")
    ap.add_argument(
        "--servers", default=",".join(SERVERS), help="which /v1 servers to run beside plain vLLM (vllm,transformers)"
    )
    ap.add_argument("--clients", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "vllm_backend.png")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plain-worker", metavar="MODEL_PATH")
    args = ap.parse_args()
    if args.plain_worker:
        plain_worker(args.plain_worker, args.dtype)
        return
    clients = args.clients or [1, 4, 8, 16]
    names = [s for s in args.servers.split(",") if s]
    assert names and set(names) <= set(SERVERS), names
    assert max(clients) <= MAX_NUM_SEQS and max(clients) <= len(TOPICS)
    asset_root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
    model_path = asset_root / "models" / args.model
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"{model_path} is missing: run `manage.py create_demo_assets --output {asset_root}`")

    t0 = time.monotonic()
    plain = Plain(model_path, args.dtype)
    print(f"plain vLLM ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    servers: dict[str, Server] = {}
    samples: dict = {"plain": {n: [] for n in clients}}
    samples.update({s: {st: {n: [] for n in clients} for st in STEERINGS} for s in names})
    paired: dict = {s: {st: {n: [] for n in clients} for st in STEERINGS} for s in names}
    loads: list[float] = []
    try:
        for name in names:
            t0 = time.monotonic()
            extra = {"MILLM_BACKEND": name}
            if name == "vllm":
                extra.update({**VLLM_ENV, "VLLM_DISTRIBUTED_EXECUTOR": "uni", "VLLM_MAX_NUM_SEQS": str(MAX_NUM_SEQS)})
            servers[name] = Server(
                batching=True,
                model=args.model,
                asset_root=asset_root,
                clients=max(clients),
                extra_env=extra,
                dtype=args.dtype if name == "vllm" else args.transformers_dtype,
            )
            print(f"{name} server ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        d_sae = 0
        for server in servers.values():
            _, d_sae = setup_steering(server, args.model)
        kw = {"model": args.model, "tokens": args.tokens, "d_sae": d_sae}
        plain.run(2, 8)
        for server in servers.values():  # warm-up
            run_server(server, 2, "monitored", **kw)
        for r in range(args.rounds):
            for n in clients:
                order = ["plain"] + [(s, st) for s in names for st in STEERINGS]
                if (r + n) % 2:
                    order.reverse()
                base = None
                got: dict = {}
                for what in order:
                    if what == "plain":
                        res = plain.run(n, args.tokens)
                        base = res["throughput"]
                        samples["plain"][n].append(base)
                        label = "plain vLLM"
                    else:
                        name, steering = what
                        res = run_server(servers[name], n, steering, **kw)
                        samples[name][steering][n].append(res)
                        got[what] = res["throughput"]
                        label = f"{name} {steering}"
                    loads.append(os.getloadavg()[0])
                    print(
                        f"round {r} n={n:<2} {label:<24} {res['throughput']:7.1f} tok/s  load {loads[-1]:.1f}",
                        file=sys.stderr,
                    )
                for (name, steering), tput in got.items():
                    paired[name][steering][n].append(tput / base)
    finally:
        plain.stop()
        for server in servers.values():
            server.stop()

    figures: dict = {"plain": {n: statistics.median(v) for n, v in samples["plain"].items()}}
    for name in names:
        figures[name] = {
            st: {
                n: {
                    "throughput": statistics.median(x["throughput"] for x in per_n),
                    "ttft_ms": statistics.median(t for x in per_n for t in x["ttft"]) * 1000,
                    "tpot_ms": statistics.median(t for x in per_n for t in x["tpot"]) * 1000,
                    "vs_plain": statistics.median(paired[name][st][n]),
                }
                for n, per_n in per_st.items()
            }
            for st, per_st in samples[name].items()
        }

    import platform

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    print(
        f"\n{args.model} {args.dtype} (transformers backend {args.transformers_dtype}), {args.tokens} tokens per client, {args.rounds} rounds, {cpu}, "
        f"{os.cpu_count()} CPUs, load average during runs {min(loads):.1f}–{max(loads):.1f}"
    )
    print(f"{'':<14} {'steering':<10} " + " ".join(f"{'N=' + str(n):>16}" for n in clients))
    print(f"{'plain vLLM':<14} {'-':<10} " + " ".join(f"{figures['plain'][n]:10.1f} tok/s" for n in clients))
    for name in names:
        for st in STEERINGS:
            print(
                f"{name:<14} {st:<10} "
                + " ".join(
                    f"{figures[name][st][n]['throughput']:7.1f} {figures[name][st][n]['vs_plain']:5.2f}x"
                    for n in clients
                )
            )
    nmax = clients[-1]
    v = figures["vllm"]
    print(
        f"\nratios to plain vLLM at N={nmax} (median of paired rounds): "
        f"unsteered {v['unsteered'][nmax]['vs_plain']:.3f}, mixed {v['mixed'][nmax]['vs_plain']:.3f} "
        f"(target >= 0.95), monitored {v['monitored'][nmax]['vs_plain']:.3f} (target >= 0.90)"
        + (
            f"; transformers mixed {figures['transformers']['mixed'][nmax]['vs_plain']:.3f}"
            if "transformers" in names
            else ""
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "dtype": args.dtype,
                    "transformers_dtype": args.transformers_dtype,
                    "tokens": args.tokens,
                    "rounds": args.rounds,
                    "cpu": cpu,
                    "cpus": os.cpu_count(),
                    "figures": figures,
                    "paired": paired,
                    "samples": samples,
                    "loads": loads,
                },
                indent=2,
            )
        )
    if args.plot and str(args.plot) not in (".", "none"):  # --plot none: no plot
        try:
            plot(
                figures,
                clients,
                args.plot,
                f"{args.model} {args.dtype} (transformers {args.transformers_dtype}) on {os.cpu_count()} CPU cores ({cpu}),\n"
                f"{args.tokens} tokens per client, medians of {args.rounds} rounds",
            )
            print(f"plot: {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
