"""Interactive time to first token while a Batch API job runs (a benchmark, not a test).

One real server (``manage.py serve``, continuous batching, the demo model SmolLM2-135M in
float32 on CPU, MAX_CONCURRENT_REQUESTS interactive rows and BATCH_ENGINE_ROWS rows for
batch lines; see benchmarks/v1_concurrency.py's ``Server``). The interactive client
streams one greedy completion at a time and measures request sent → first content
frame:

1. idle: ``--samples`` requests with nothing else running;
2. busy: a ``--lines``-line batch (completions of ``--line-tokens`` tokens each) is
   uploaded with the official ``openai`` client and created; once its lines run, the same
   ``--samples`` interactive requests are measured while it runs (the batch's progress is
   printed before and after, to show it kept running);
3. idle again after the batch is cancelled (so the idle figure brackets the busy one).

Printed: the medians, p90s, and the ratio busy ÷ idle (target ≤ 1.5, SPEC §7). Usage:

    MILLM_TEST_ASSET_DIR=... .venv/bin/python benchmarks/batch_ttft.py --lines 1000 --samples 30
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sse import sse_events  # noqa: E402
from benchmarks.v1_concurrency import Server  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Describe a night train in winter.",
    "List three facts about deep-sea divers.",
    "Explain chess openings to a child.",
]


def ttft(port: int, model: str, i: int, tokens: int) -> float:
    body = {
        "model": model,
        "prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = json.dumps(body).encode()
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"interactive request failed: {resp.status} {resp.read()[:300]!r}")
    first = None
    for event in sse_events(resp):
        choices = event.get("choices") or []
        if first is None and choices and choices[0].get("text"):
            first = time.perf_counter()
    conn.close()
    if first is None:
        raise RuntimeError("no token came back")
    return first - sent


def measure(port: int, model: str, samples: int, tokens: int, pause_s: float) -> list[float]:
    out = []
    for i in range(samples):
        out.append(ttft(port, model, i, tokens))
        time.sleep(pause_s)  # the arrival time falls anywhere in the batch's decode step
    return out


def summary(name: str, values: list[float]) -> dict:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    fig = {"median_ms": statistics.median(values) * 1000, "p90_ms": p90 * 1000, "n": len(values)}
    print(
        f"{name:<6} TTFT median {fig['median_ms']:7.1f} ms  p90 {fig['p90_ms']:7.1f} ms  (n={len(values)})",
        file=sys.stderr,
    )
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--line-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8, help="tokens of each interactive request")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--slots", type=int, default=4, help="MAX_CONCURRENT_REQUESTS")
    ap.add_argument("--batch-rows", type=int, default=4, help="BATCH_ENGINE_ROWS")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from openai import OpenAI

    asset_root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
    server = Server(
        batching=True,
        model=args.model,
        asset_root=asset_root,
        clients=args.slots,
        extra_env={"BATCH_ENGINE_ROWS": str(args.batch_rows)},
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    try:
        measure(server.port, args.model, 3, args.tokens, 0.05)  # warm-up
        idle = measure(server.port, args.model, args.samples, args.tokens, 0.05)
        rows = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": args.model,
                    "prompt": PROMPTS[i % 4] + f" [{i}]",
                    "max_tokens": args.line_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            for i in range(args.lines)
        ]
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        file = client.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while client.batches.retrieve(batch.id).request_counts.completed < 2 * args.batch_rows:
            if time.monotonic() > deadline:
                raise RuntimeError("the batch did not start")
            time.sleep(0.2)
        t0 = time.perf_counter()
        before = client.batches.retrieve(batch.id).request_counts.completed
        busy = measure(server.port, args.model, args.samples, args.tokens, 0.05)
        after = client.batches.retrieve(batch.id)
        elapsed = time.perf_counter() - t0
        lines_per_s = (after.request_counts.completed - before) / elapsed
        print(
            f"batch {after.status}: {after.request_counts.completed}/{args.lines} lines answered, "
            f"{lines_per_s:.2f} lines/s ({lines_per_s * args.line_tokens:.0f} tok/s) during the busy "
            f"samples",
            file=sys.stderr,
        )
        if after.status != "in_progress":
            raise RuntimeError("the batch ended before the busy samples did: use more --lines")
        client.batches.cancel(batch.id)
        deadline = time.monotonic() + 300
        while client.batches.retrieve(batch.id).status != "cancelled":
            if time.monotonic() > deadline:
                raise RuntimeError("the batch did not cancel")
            time.sleep(0.2)
        idle_after = measure(server.port, args.model, args.samples, args.tokens, 0.05)
        figures = {
            "idle": summary("idle", idle + idle_after),
            "busy": summary("busy", busy),
            "batch_lines_per_s": lines_per_s,
            "load": os.getloadavg()[0],
            "settings": vars(args) | {"json": None},
        }
        figures["ratio_median"] = figures["busy"]["median_ms"] / figures["idle"]["median_ms"]
        print(
            f"interactive TTFT while a {args.lines}-line batch runs: "
            f"{figures['ratio_median']:.2f}x idle (median; target <= 1.5)",
            file=sys.stderr,
        )
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
