"""Concurrent streaming clients through /v1: serial engine vs continuous batching
(a benchmark, not a test).

Two real servers run side by side, one per mode (``ENABLE_CONTINUOUS_BATCHING`` false /
true), each its own process — ``manage.py serve`` (daphne) on a free loopback port, a
throw-away SQLite data directory, the demo assets registered with ``create_demo_assets``,
``AUTO_LOAD_MODEL`` (SmolLM2-135M, float32, CPU), ``MAX_CONCURRENT_REQUESTS=16`` — and the
demo SAE is attached at its layer through /api.  Then, round after round, N concurrent
clients (one HTTP connection each, all driven from one thread of this process with
non-blocking sockets: ``benchmarks.sse.stream_clients``) each stream one greedy
completion of ``--tokens`` tokens (``ignore_eos``), all-unsteered or with mixed steering,
against the serial server and then the batching one (order alternating), so every
batched/serial ratio is a pair measured under the same outside load:

    client i % 4 == 0   no steering
    client i % 4 == 1   inline steering, 4 features
    client i % 4 == 2   inline steering, 4 other features, other strengths
    client i % 4 == 3   a profile (8 features) with steering_intensity 0.5

Figures per (mode, steering, N): throughput = all completion tokens / (first request
sent → last stream closed); time to first token (request sent → first content frame)
and time per output token ((last frame − first frame) / (frames − 1)), medians over the
clients and rounds.  Ratios printed from the same run: batched ÷ serial throughput at
each N, mixed ÷ unsteered batch, and batched ÷ serial at N = 1 (the path a lone request
takes).  A PNG plot goes to ``--plot``.  Usage:

    .venv/bin/python benchmarks/v1_concurrency.py --rounds 2 --plot docs/img/v1_concurrency.png

``--batched-only --clients 16 --rounds 6`` skips the serial server, so the batch's mixed and
unsteered runs alternate back to back (the pairs that the mixed ÷ unsteered ratio needs;
with the serial runs in between, minutes separate them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.prompts import story_prompt
from benchmarks.sse import stream_clients

MODES = ("serial", "batched")
STEERINGS = ("unsteered", "mixed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``manage.py serve`` process in its own data directory."""

    def __init__(
        self,
        *,
        batching: bool,
        model: str,
        asset_root: Path,
        clients: int,
        dtype: str = "float32",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.data = tempfile.mkdtemp(prefix="millm-bench-conc-")
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")},
            "MILLM_ENV_FILE": "/nonexistent/.env",
            "MILLM_DATA_DIR": self.data,
            "LOG_LEVEL": "WARNING",
            "MILLM_ENGINE_DEVICE": "cpu",
            "MILLM_ENGINE_DTYPE": dtype,
            "AUTO_LOAD_MODEL": model,
            "MAX_CONCURRENT_REQUESTS": str(clients),
            "MAX_PENDING_REQUESTS": str(clients),
            "ENABLE_CONTINUOUS_BATCHING": "true" if batching else "false",
            "MILLM_TEST_ASSET_DIR": str(asset_root),
            **(extra_env or {}),
        }
        manage = [sys.executable, str(REPO / "manage.py")]
        # the profile is written straight into the fresh database: the server reads it per request
        profile = (
            "from registry.models import SAE\n"
            "from steering.services import profile_create\n"
            f"sae = SAE.objects.filter(name__startswith={model!r}).order_by('name').first()\n"
            "profile_create(name='bench', sae_id=sae.id, layer=sae.trained_on_layer, "
            f"model_name={model!r}, steering={{str(i * 61 % sae.d_sae): 6.0 for i in range(8)}})\n"
        )
        for cmd in (
            ["migrate", "-v", "0"],
            ["create_demo_assets", "--output", str(asset_root)],
            ["shell", "-v", "0", "-c", profile],
        ):
            subprocess.run(manage + cmd, env=self.env, cwd=REPO, check=True, capture_output=True, timeout=600)
        self.log = open(Path(self.data) / "serve.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            manage + ["serve", "--port", str(self.port)],
            env=self.env,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while self.call("GET", "/api/health/ready")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not become ready; see {self.log.name}")
            time.sleep(0.5)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            conn.request(
                method,
                path,
                body=None if body is None else json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            return resp.status, (json.loads(data) if data else {})
        except (OSError, ValueError):
            return 0, {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def setup_steering(server: Server, model: str) -> tuple[str, int]:
    status, saes = server.call("GET", "/api/saes")
    demo = sorted((s for s in saes["data"]["saes"] if s["name"].startswith(model)), key=lambda s: s["name"])
    if status != 200 or not demo:
        raise RuntimeError(f"no demo SAE for {model} is registered: {saes}")
    sae = demo[0]
    layer = sae["trained_layer"] if sae.get("trained_layer") is not None else 12
    status, out = server.call("POST", f"/api/saes/{sae['id']}/attach", {"layer": layer})
    if status != 200:
        raise RuntimeError(f"attach failed: {status} {out}")
    return sae["id"], sae["d_sae"]


def body(i: int, *, model: str, tokens: int, steering: str, d_sae: int) -> dict:
    b = {
        "model": model,
        "prompt": story_prompt(i),
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if steering == "mixed":
        kind = i % 4
        if kind == 1:
            b["steering"] = {"features": [{"index": (i * 37 + j * 101) % d_sae, "strength": 5.0} for j in range(4)]}
        elif kind == 2:
            b["steering"] = {
                "features": [{"index": (i * 53 + j * 211) % d_sae, "strength": -3.0 - j} for j in range(4)]
            }
        elif kind == 3:
            b["profile"], b["steering_intensity"] = "bench", 0.5
    return b


def run_clients(server: Server, n: int, *, make_body=None, **kw) -> dict:
    make = make_body or body
    results = stream_clients(server.port, "/v1/completions", [make(i, **kw) for i in range(n)])
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]}")
    start = min(r["sent"] for r in results)
    end = max(r["end"] for r in results)
    return {
        "throughput": sum(r["tokens"] for r in results) / (end - start),
        "ttft": [r["frames"][0] - r["sent"] for r in results],
        "tpot": [(r["frames"][-1] - r["frames"][0]) / (len(r["frames"]) - 1) for r in results if len(r["frames"]) > 1],
        "tokens": sum(r["tokens"] for r in results),
    }


def plot(figures: dict, clients: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("throughput", "throughput (tok/s)"),
        ("ttft_ms", "time to first token (ms, median)"),
        ("tpot_ms", "time per output token (ms, median)"),
    )
    for ax, (key, label) in zip(axes, panels):
        for mode in MODES:
            for steering in STEERINGS:
                ys = [figures[mode][steering][n][key] for n in clients]
                ax.plot(
                    clients,
                    ys,
                    marker="o",
                    linestyle="-" if steering == "unsteered" else "--",
                    color="tab:blue" if mode == "batched" else "tab:gray",
                    label=f"{mode}, {steering}",
                )
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.set_xticks(clients)
        if key == "ttft_ms":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "v1_concurrency.png")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--batched-only",
        action="store_true",
        help="skip the serial server: only the batch's mixed/unsteered pairs, back to back",
    )
    args = ap.parse_args()
    modes = ("batched",) if args.batched_only else MODES
    clients = args.clients or [1, 4, 8, 16]
    asset_root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")

    samples: dict = {
        m: {s: {n: {"throughput": [], "ttft": [], "tpot": []} for n in clients} for s in STEERINGS} for m in MODES
    }
    paired: dict = {s: {n: [] for n in clients} for s in STEERINGS}  # batched / serial, same round
    loads: list[float] = []
    # both servers run for the whole benchmark; the one not being measured sits idle, which
    # costs nothing (no thread of either engine runs without work), and measuring the two
    # back to back makes each ratio a pair taken under the same outside load
    servers = {
        mode: Server(batching=mode == "batched", model=args.model, asset_root=asset_root, clients=max(clients))
        for mode in modes
    }
    try:
        d_sae = 0
        for server in servers.values():
            _, d_sae = setup_steering(server, args.model)
        kw = {"model": args.model, "tokens": args.tokens, "d_sae": d_sae}
        for server in servers.values():
            run_clients(server, 2, steering="mixed", **kw)  # warm-up
        for r in range(args.rounds):
            for n in clients:
                for steering in STEERINGS if (r + n) % 2 == 0 else STEERINGS[::-1]:
                    pair = {}
                    for mode in modes if (r + n) % 2 == 0 else modes[::-1]:
                        res = run_clients(servers[mode], n, steering=steering, **kw)
                        cell = samples[mode][steering][n]
                        cell["throughput"].append(res["throughput"])
                        cell["ttft"].extend(res["ttft"])
                        cell["tpot"].extend(res["tpot"])
                        pair[mode] = res["throughput"]
                        loads.append(os.getloadavg()[0])
                        print(
                            f"round {r} {mode:<7} {steering:<9} n={n:<2} {res['throughput']:7.1f} tok/s  "
                            f"TTFT {statistics.median(res['ttft']) * 1000:8.0f} ms  "
                            f"TPOT {statistics.median(res['tpot']) * 1000:6.1f} ms  load {loads[-1]:.1f}",
                            file=sys.stderr,
                        )
                    if "serial" in pair:
                        paired[steering][n].append(pair["batched"] / pair["serial"])
    finally:
        for server in servers.values():
            server.stop()

    figures = {
        m: {
            s: {
                n: {
                    "throughput": statistics.median(c["throughput"]),
                    "throughput_best": max(c["throughput"]),
                    "ttft_ms": statistics.median(c["ttft"]) * 1000,
                    "tpot_ms": statistics.median(c["tpot"]) * 1000,
                }
                for n, c in per_s.items()
            }
            for s, per_s in per_m.items()
        }
        for m, per_m in samples.items()
        if m in modes
    }

    print(
        f"\n{args.model} fp32, {args.tokens} tokens per client, {args.rounds} rounds, "
        f"load average during runs {min(loads):.1f}–{max(loads):.1f}"
    )
    print(f"{'mode':<8} {'steering':<10} {'N':>3} {'tok/s':>8} {'best':>8} {'TTFT ms':>9} {'TPOT ms':>8}")
    for m in modes:
        for s in STEERINGS:
            for n in clients:
                f = figures[m][s][n]
                print(
                    f"{m:<8} {s:<10} {n:>3} {f['throughput']:8.1f} {f['throughput_best']:8.1f} "
                    f"{f['ttft_ms']:9.0f} {f['tpot_ms']:8.1f}"
                )
    print("\nratios (median of the rounds' paired ratios; ratio of medians in brackets)")
    if args.batched_only:
        print(
            "  mixed / unsteered, batched throughput, each round's pair: "
            + "; ".join(
                f"N={n} "
                + ", ".join(
                    f"{x / y:.3f}"
                    for x, y in zip(
                        samples["batched"]["mixed"][n]["throughput"], samples["batched"]["unsteered"][n]["throughput"]
                    )
                )
                for n in clients
            )
        )
    for s in STEERINGS if not args.batched_only else ():
        print(
            f"  batched / serial throughput, {s}: "
            + ", ".join(
                f"N={n} {statistics.median(paired[s][n]):.2f}× "
                f"[{figures['batched'][s][n]['throughput'] / figures['serial'][s][n]['throughput']:.2f}×]"
                for n in clients
            )
        )
    for m in modes:
        print(
            f"  mixed / unsteered, {m} throughput: "
            + ", ".join(
                f"N={n} {statistics.median(x / y for x, y in zip(samples[m]['mixed'][n]['throughput'], samples[m]['unsteered'][n]['throughput'])):.3f}"
                for n in clients
            )
        )
    n1 = clients[0]
    for s in STEERINGS if not args.batched_only else ():
        b, se = figures["batched"][s][n1], figures["serial"][s][n1]
        print(
            f"  N={n1} ({s}) batched / serial: throughput {b['throughput'] / se['throughput']:.3f}, "
            f"TTFT {b['ttft_ms'] / se['ttft_ms']:.3f}, TPOT {b['tpot_ms'] / se['tpot_ms']:.3f}"
        )
    nmax = clients[-1]
    if args.batched_only:
        args.plot = None
    else:
        print(
            f"  N={nmax} TTFT batched / serial: unsteered "
            f"{figures['batched']['unsteered'][nmax]['ttft_ms'] / figures['serial']['unsteered'][nmax]['ttft_ms']:.3f}, "
            f"TPOT batched / serial: {figures['batched']['unsteered'][nmax]['tpot_ms'] / figures['serial']['unsteered'][nmax]['tpot_ms']:.2f}"
        )
    if args.plot:
        plot(
            figures,
            clients,
            args.plot,
            f"{args.model} fp32 on {os.cpu_count()} CPU cores, {args.tokens} tokens "
            f"per client, /v1 streaming, medians of {args.rounds} rounds",
        )
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(
            json.dumps({"figures": figures, "samples": samples, "paired": paired, "loads": loads}, indent=2)
        )


if __name__ == "__main__":
    main()
