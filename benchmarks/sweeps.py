"""A steering sweep against the same generations sent to /v1 (issue 35's targets: a sweep
of P prompts × S strengths runs at ≥ 0.8× the throughput of the same P×S generations sent
as concurrent /v1 requests to the batching server, and ≥ 5× the same points sent one at a
time). A benchmark, not a test.

One process, one backend (``--backend``): the site's own settings on a throw-away SQLite
data directory (``benchmarks.dashboards.setup``: continuous batching on, ``--rows`` rows
for interactive and batch work, the prefix cache off), the demo model (SmolLM2-135M;
``--model tiny-llama`` for a smoke run) loaded through the registry and its SAE attached,
daphne serving the real ASGI app on a loopback port. The grid is ``--prompts`` P story
prompts × ``--strengths`` S strengths of one feature of the SAE (the demo SAE's first
labelled feature, strengths spread evenly up to the demo's visible strength), greedy,
``--max-tokens`` new tokens. Then, round after round and in rotating order:

  sweep       ``POST /api/experiments/sweep`` with those prompts, that variant and those
              strengths, waited for until complete: P×S points ÷ POST sent → run
              complete. The run does all a sweep does — each prompt's DEFAULT, every
              point's generation with the target monitored before and after the layer,
              the teacher-forced KL passes and the log-likelihood passes — so the sweep
              pays for everything it reports;
  concurrent  the P×S generations as /v1/completions requests through the official
              ``openai`` client, all sent at once (MAX_CONCURRENT_REQUESTS = ``--rows``,
              the rest waiting in the admission queue), each with the point's inline
              steering ``{sae_id, features: [{index, strength}]}``, the same
              ``max_tokens`` and ``temperature: 0``: P×S ÷ first sent → last answered;
  sequential  the same requests one at a time.

Ratios per round, medians over the rounds: sweep ÷ concurrent (target ≥ 0.8) and sweep ÷
sequential (target ≥ 5). The run also counts the points whose sweep text equals the
concurrent /v1 text (the sweep's generation is the /v1 job; a difference would mean the
two sides did not run the same work).

    .venv/bin/python benchmarks/sweeps.py --backend transformers --rounds 3
    .venv/bin/python benchmarks/sweeps.py --model tiny-llama --prompts 2 --strengths 2 --max-tokens 4 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.dashboards import DEMO_MODEL, setup  # noqa: E402
from benchmarks.prompts import story_prompt  # noqa: E402

TINY_SAE = {"tiny-llama": ("tiny-llama-L1-relu", 1, 5, 8.0)}  # model: (SAE, layer, feature, top strength)
TERMINAL = ("completed", "failed", "cancelled")
SIDES = ("sweep", "concurrent", "sequential")


def load(backend: str, model: str) -> tuple[object, object, int, float]:
    """The model on ``backend`` with its SAE attached: (model row, SAE row, the feature
    swept, the largest strength)."""
    from benchmarks import dashboards

    if model == DEMO_MODEL:
        from offline_assets import DEMO_SAE_NAME, ensure_assets

        row, sae = dashboards.load(backend)
        root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
        asset = ensure_assets(root, include_demo=True).saes[DEMO_SAE_NAME]
        return row, sae, min(asset.feature_labels), float(asset.steering_strength or 10.0)
    if backend != "transformers" or model not in TINY_SAE:
        raise SystemExit(f"--model {model}: only {DEMO_MODEL} (any backend) or tiny-llama (transformers)")
    from orchestration.services import model_load, sae_attach
    from registry.models import SAE, Model
    from registry.services import demo_assets_install

    root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
    demo_assets_install(root=root, include_demo=False)
    row = Model.objects.get(name=model)
    model_load(model=row)
    name, layer, feature, top = TINY_SAE[model]
    sae = SAE.objects.get(name=name)
    sae_attach(sae=sae, layer=layer)
    return row, SAE.objects.get(pk=sae.pk), feature, top


def sweep(base: str, body: dict) -> tuple[float, list[str]]:
    """One sweep through /api, waited for: (seconds, the points' texts in grid order,
    defaults left out)."""
    import httpx

    from experiments.models import ExperimentRun

    t0 = time.perf_counter()
    resp = httpx.post(f"{base}/api/experiments/sweep", json=body, timeout=60)
    if resp.status_code != 202:
        raise RuntimeError(f"the sweep was refused: {resp.status_code} {resp.text[:300]}")
    run_id = resp.json()["data"]["run"]["id"]
    while True:
        run = ExperimentRun.objects.get(id=run_id)
        if run.status in TERMINAL:
            break
        time.sleep(0.01)
    dt = time.perf_counter() - t0
    if run.status != "completed":
        raise RuntimeError(f"sweep {run_id} ended {run.status}: {run.error}")
    texts = list(run.points.filter(is_default=False).order_by("ordinal").values_list("text", flat=True))
    return dt, texts


def v1_requests(model: str, sae_id: str, feature: int, prompts: list[str], strengths: list[float], max_tokens: int):
    """The sweep's points as /v1/completions bodies, in the sweep's grid order."""
    return [
        {
            "model": model,
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "extra_body": {"steering": {"sae_id": sae_id, "features": [{"index": feature, "strength": s}]}},
        }
        for p in prompts
        for s in strengths
    ]


def v1(client, bodies: list[dict], concurrent: bool) -> tuple[float, list[str]]:
    """The bodies through the official client, all at once or one at a time: (seconds,
    texts in order)."""

    def one(body: dict) -> str:
        return client.completions.create(**body).choices[0].text

    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(bodies)) as pool:
            texts = list(pool.map(one, bodies))
    else:
        texts = [one(b) for b in bodies]
    return time.perf_counter() - t0, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("transformers", "vllm", "llamacpp"), default="transformers")
    ap.add_argument("--model", default=DEMO_MODEL, help=f"{DEMO_MODEL} (default) or tiny-llama (a smoke run)")
    ap.add_argument("--prompts", type=int, default=8, help="P: story prompts")
    ap.add_argument("--strengths", type=int, default=4, help="S: strengths of the one feature swept")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=16, help="the engine's batch rows (interactive, batch, experiment)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="float32 (transformers, llama.cpp) / bfloat16 (vLLM) by default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    points = args.prompts * args.strengths
    # every /v1 request of the concurrent side is admitted: rows run, the rest wait in the queue
    os.environ.update(
        {
            "EXPERIMENT_ENGINE_ROWS": str(args.rows),
            "MAX_PENDING_REQUESTS": str(max(points, 1)),
            "EXPERIMENT_MAX_POINTS": str(max(256, args.prompts * (1 + args.strengths))),
        }
    )
    dtype = args.dtype or ("bfloat16" if args.backend == "vllm" else "float32")
    setup(args.backend, args.rows, dtype)
    from openai import OpenAI

    from benchmarks.v1_streaming import start_daphne

    t0 = time.monotonic()
    model, sae, feature, top = load(args.backend, args.model)
    host, port = start_daphne()
    base = f"http://{host}:{port}"
    print(f"{args.backend}: {model.name} loaded, {sae.name} attached in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    prompts = [story_prompt(i) for i in range(args.prompts)]
    strengths = [round(top * (k + 1) / args.strengths, 4) for k in range(args.strengths)]
    body = {
        "prompts": prompts,
        "variants": [{"sae_id": sae.id, "index": feature}],
        "strengths": strengths,
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
    }
    bodies = v1_requests(model.name, sae.id, feature, prompts, strengths, args.max_tokens)
    client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=1800)

    # warm-up: each path's first batch once
    sweep(base, {**body, "prompts": prompts[:1], "strengths": strengths[:1]})
    v1(client, bodies[: min(len(bodies), args.rows)], concurrent=True)

    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    ratios: dict[str, list[float]] = {"sweep_over_concurrent": [], "sweep_over_sequential": []}
    same_texts, loads = [], []
    for r in range(args.rounds):
        got: dict[str, float] = {}
        order = SIDES[r % 3 :] + SIDES[: r % 3]  # each side first in turn
        texts: dict[str, list[str]] = {}
        for side in order:
            if side == "sweep":
                got[side], texts[side] = sweep(base, body)
            else:
                got[side], texts[side] = v1(client, bodies, concurrent=side == "concurrent")
            loads.append(os.getloadavg()[0])
        for side in SIDES:
            seconds[side].append(got[side])
        ratios["sweep_over_concurrent"].append(got["concurrent"] / got["sweep"])
        ratios["sweep_over_sequential"].append(got["sequential"] / got["sweep"])
        same_texts.append(sum(a == b for a, b in zip(texts["sweep"], texts["concurrent"], strict=True)))
        print(
            f"round {r}: "
            + ", ".join(f"{s} {got[s]:.2f} s ({points / got[s]:.2f} points/s)" for s in SIDES)
            + f"; sweep ÷ concurrent {ratios['sweep_over_concurrent'][-1]:.3f}, "
            f"sweep ÷ sequential {ratios['sweep_over_sequential'][-1]:.3f}; "
            f"{same_texts[-1]}/{points} texts equal; load {loads[-1]:.1f}",
            file=sys.stderr,
            flush=True,
        )
    figures = {
        "backend": args.backend,
        "model": model.name,
        "dtype": dtype,
        "sae": sae.name,
        "feature": feature,
        "prompts": args.prompts,
        "strengths": strengths,
        "points": points,
        "max_tokens": args.max_tokens,
        "rows": args.rows,
        "rounds": args.rounds,
        "seconds": {s: statistics.median(v) for s, v in seconds.items()},
        "points_per_s": {s: points / statistics.median(v) for s, v in seconds.items()},
        "sweep_over_concurrent": statistics.median(ratios["sweep_over_concurrent"]),
        "sweep_over_sequential": statistics.median(ratios["sweep_over_sequential"]),
        "ratios": ratios,
        "texts_equal": min(same_texts),
        "load_average": {"min": min(loads), "max": max(loads)},
    }
    print(
        f"{args.backend} {model.name} {dtype}, {sae.name} feature {feature}, {args.prompts} prompts × "
        f"{args.strengths} strengths ({points} points), {args.max_tokens} tokens, {args.rows} rows, "
        f"{args.rounds} round(s): sweep {figures['points_per_s']['sweep']:.2f} points/s, concurrent /v1 "
        f"{figures['points_per_s']['concurrent']:.2f}, one at a time {figures['points_per_s']['sequential']:.2f}"
    )
    print(
        f"sweep ÷ concurrent /v1 {figures['sweep_over_concurrent']:.3f} (target ≥ 0.8), "
        f"sweep ÷ one at a time {figures['sweep_over_sequential']:.3f} (target ≥ 5); "
        f"texts equal {figures['texts_equal']}/{points}; load average "
        f"{figures['load_average']['min']:.1f}–{figures['load_average']['max']:.1f}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    os._exit(0)  # the engine's and daphne's threads are daemons; skip their joins


if __name__ == "__main__":
    main()
