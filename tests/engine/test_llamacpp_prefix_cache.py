"""The prefix cache on the llama.cpp backend (PREFIX_CACHE_MAX_MB; backends/llamacpp/prefix.py).

The oracle is the same engine without the cache (``prefix_cache_max_mb`` 0), on the same
tiny float32 GGUF: a multi-turn chat — each turn the conversation so far resent with the
previous answers, as a chat client does — gives the same greedy tokens, top-5 logprobs
and monitored activations turn by turn with the cache on as off, unsteered, with prompt
steering and with decode-only steering, on the serial and the batched paths (the batched
one in both steering modes: per row in the eval callback, and the control_vector_swap
fallback, which refuses feature controls); and the later turns did reuse stored KV (the status' hit counters, which the metrics show).
Prompt-steered requests never reuse unsteered KV (a counter that stays at 0, outputs equal
to the uncached run, and a positive control where keying everything as unsteered does
change the outputs); namespaces (``cache_namespace``, /v1's ``prompt_cache_key``) keep
their entries apart; a KV cache too small for a new prompt and the stored entries drops
entries and still answers as the uncached engine does.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    FeatureControl,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.backends.llamacpp.prefix import CACHE_SLOTS
from gpu_engine.runtime.engine import Engine

from .test_llamacpp import ENCODE_ATOL, assert_same_generation, gguf_job

L1 = "tiny-llama-L1-relu"
CACHE_MB = 64
TURNS = [
    "hello there, how are you today? tell me a story about a cat",
    "the cat sat on the mat and then what happened",
    "a quick brown fox jumps over the lazy dog while the sun sets",
    "one two three four five six seven eight nine ten",
]
# the batched path in both steering modes: per row in the eval callback (this CPU build's
# choice) and the control_vector_swap fallback (forced)
PATHS = ("serial", "batched", "swap")
KINDS = ("none", "monitored", "prompt", "decode_only")


def _engine(tiny_gguf, path: str, mb: int, rows: int = 4, **options) -> Engine:
    batching = BatchingOptions(enabled=True, max_batch_size=rows) if path != "serial" else None
    if path == "swap":
        options["steering_mode"] = "control_vector_swap"
    eng = Engine(batching=batching)
    eng.load_model(gguf_job(tiny_gguf, prefix_cache_max_mb=mb, **options))
    return eng


@pytest.fixture(scope="module")
def engines(tiny_gguf, tiny_assets):
    """{(path, cache on): engine}, each with the layer-1 SAE attached."""
    made = {(p, on): _engine(tiny_gguf, p, CACHE_MB if on else 0) for p in PATHS for on in (True, False)}
    a = tiny_assets.saes[L1]
    for (path, _on), eng in made.items():
        eng.attach(AttachSpec(a.name, str(a.path), a.layer))
        mode = eng.status().batching["capabilities"]["steering_mode"] if path != "serial" else None
        assert mode == {"serial": None, "batched": "eval_callback_per_row", "swap": "control_vector_swap"}[path]
    yield made
    for eng in made.values():
        eng.shutdown()


def counters(eng: Engine, klass: str) -> dict:
    """The prefix cache's counters of ``klass`` as the engine's status reports them."""
    return dict(eng.status().memory["prefix_cache"]["classes"][klass])


def job(rid, messages=None, *, prompt=None, steering=None, monitor=None, namespace=None, n=6) -> GenerationJob:
    return GenerationJob(
        rid,
        messages=messages,
        prompt=prompt,
        steering=steering,
        monitor=monitor,
        cache_namespace=namespace,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5),
    )


def converse(eng: Engine, tag: str, **kw) -> list:
    """The chat of ``TURNS``: each turn the whole conversation with the answers so far."""
    messages: list[dict] = []
    results = []
    for i, text in enumerate(TURNS):
        messages.append({"role": "user", "content": f"[{tag}] {text}" if i == 0 else text})
        r = eng.generate_sync(job(f"{tag}-{i}", list(messages), **kw), timeout_s=120)
        results.append(r)
        messages.append({"role": "assistant", "content": r.text})
    return results


def steering(kind: str) -> SteeringSpec | None:
    if kind == "prompt":
        return SteeringSpec([SteeringEntry(L1, 1, {3: 6.0, 40: -4.0})])
    if kind == "decode_only":
        return SteeringSpec([SteeringEntry(L1, 1, {}, [FeatureControl(3, value=12.0, phase="completion")])])
    return None


MONITOR = MonitorSpec([MonitorEntry(L1, 1, top_k=4, features=[3, 40], positions="completion")])
KLASS = {"none": "unsteered", "monitored": "unsteered", "prompt": "prompt_steered", "decode_only": "decode_only"}


def assert_same_records(got, want) -> None:
    assert [(r.read_point, r.position) for r in got.activations] == [
        (r.read_point, r.position) for r in want.activations
    ]
    assert got.activations, "the monitor recorded nothing"
    for g, w in zip(got.activations, want.activations):
        np.testing.assert_allclose(
            [f.activation for f in g.features], [f.activation for f in w.features], atol=ENCODE_ATOL
        )
        assert [f.feature_index for f in g.top_k] == [f.feature_index for f in w.top_k]


# the swap mode refuses feature controls (phase included) before anything runs
@pytest.mark.parametrize(("path", "kind"), [(p, k) for p in PATHS for k in KINDS if (p, k) != ("swap", "decode_only")])
def test_a_chat_with_the_prefix_cache_equals_the_chat_without(engines, path, kind):
    on, off = engines[(path, True)], engines[(path, False)]
    kw = {"steering": steering(kind), "monitor": MONITOR if kind == "monitored" else None}
    before = counters(on, KLASS[kind])
    cached = converse(on, f"{path}-{kind}", **kw)
    after = counters(on, KLASS[kind])
    plain = converse(off, f"{path}-{kind}", **kw)
    for got, want in zip(cached, plain):
        assert_same_generation(got, want)
        if kind == "monitored":
            assert_same_records(got, want)
    # every turn after the first reused the conversation so far (its first turn starts
    # with a tag no other conversation has, so it found at most the template's opening)
    assert after["lookups"] - before["lookups"] == len(TURNS)
    assert after["hits"] - before["hits"] >= len(TURNS) - 1
    first_prompt = cached[0].usage.prompt_tokens
    assert after["tokens_reused"] - before["tokens_reused"] > first_prompt * (len(TURNS) - 1)
    # the uncached engine looked nothing up
    assert counters(off, KLASS[kind])["hits"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_prompt_steered_requests_never_reuse_unsteered_kv(engines, path, monkeypatch):
    on, off = engines[(path, True)], engines[(path, False)]
    base = [{"role": "user", "content": f"[{path}] keys: " + " ".join(TURNS)}]
    longer = [*base, {"role": "assistant", "content": "the cat"}, {"role": "user", "content": TURNS[1]}]
    # a steering no other test uses: no steered entry shares its key, so a hit could only
    # be unsteered KV
    steer = SteeringSpec([SteeringEntry(L1, 1, {3: 6.0, 40: -4.0, 11: 2.5})])
    on.generate_sync(job("plain", base), timeout_s=120)  # stores the unsteered KV of ``base``
    steered_before = counters(on, "prompt_steered")
    got = on.generate_sync(job("steered", longer, steering=steer), timeout_s=120)
    assert counters(on, "prompt_steered")["hits"] == steered_before["hits"]
    want = off.generate_sync(job("steered", longer, steering=steer), timeout_s=120)
    assert_same_generation(got, want)
    # the positive control: the unsteered repeat does reuse the stored KV ...
    plain_before = counters(on, "unsteered")
    again = on.generate_sync(job("again", longer), timeout_s=120)
    assert counters(on, "unsteered")["hits"] == plain_before["hits"] + 1
    assert_same_generation(again, off.generate_sync(job("again", longer), timeout_s=120))
    # ... and a cache keying prompt steering as unsteered would answer otherwise: the
    # test above can see the difference
    import gpu_engine.decode.prefix_cache as pc

    monkeypatch.setattr(pc, "steering_key", lambda spec, n: pc.UNSTEERED)
    on.generate_sync(job("plain2", base), timeout_s=120)
    wrong = on.generate_sync(job("steered2", longer, steering=steer), timeout_s=120)
    lp = np.array([[e.logprob for e in t.top_logprobs] for t in wrong.logprobs])
    ref = np.array([[e.logprob for e in t.top_logprobs] for t in want.logprobs])
    assert wrong.token_ids != want.token_ids or np.abs(lp - ref).max() > 1e-2


@pytest.mark.parametrize("path", PATHS)
def test_namespaces_keep_their_entries_apart(engines, path):
    on, off = engines[(path, True)], engines[(path, False)]
    first = [{"role": "user", "content": f"[{path} ns] " + TURNS[2]}]
    follow = [*first, {"role": "assistant", "content": "yes"}, {"role": "user", "content": TURNS[3]}]
    want = off.generate_sync(job("w", follow), timeout_s=120)
    stored = on.generate_sync(job("a0", first, namespace=f"team-a-{path}"), timeout_s=120).usage.prompt_tokens

    def reused(ns) -> tuple[int, int]:
        before = counters(on, "unsteered")
        got = on.generate_sync(job("x", follow, namespace=ns), timeout_s=120)
        assert_same_generation(got, want)
        after = counters(on, "unsteered")
        return after["hits"] - before["hits"], after["tokens_reused"] - before["tokens_reused"]

    # a namespace nothing was stored under finds nothing at all; the shared one finds at
    # most the chat template's opening tokens other tests' chats stored there
    assert reused(f"team-b-{path}") == (0, 0)
    assert reused(None)[1] < stored // 2
    hits, tokens = reused(f"team-a-{path}")
    assert hits == 1 and tokens >= stored - 1


@pytest.mark.parametrize("path", PATHS)
def test_a_full_kv_cache_drops_entries_and_answers_as_without(tiny_gguf, path):
    """A 64-token window: the KV holds a few windows, so the stored prompts soon leave no
    cell for a new one, which then drops entries (least recently used first).  Fewer
    prompts than the cache has slots, far under its budget: only a full KV evicts."""
    on, off = (_engine(tiny_gguf, path, mb, rows=1, context_length=64) for mb in (CACHE_MB, 0))
    try:
        n = CACHE_SLOTS - 2
        for i in range(n):
            prompt = f"{i} {TURNS[i % len(TURNS)]}"
            got = on.generate_sync(job(f"f{i}", prompt=prompt, n=4), timeout_s=120)
            assert got.finish_reason == "length", got
            assert_same_generation(got, off.generate_sync(job(f"f{i}", prompt=prompt, n=4), timeout_s=120))
        cache = on.status().memory["prefix_cache"]
        assert cache["stores"] == n and cache["bytes"] < cache["budget_bytes"] // 4
        assert cache["evictions"] > 0
    finally:
        on.shutdown()
        off.shutdown()


def test_the_capabilities_say_whether_the_cache_runs(engines):
    on = engines[("batched", True)].status().batching["capabilities"]
    off = engines[("batched", False)].status().batching["capabilities"]
    assert (on["prefix_caching"], on["prefix_caching_reason"], on["steered_prefix_cache_keyed_by_steering"]) == (
        True,
        None,
        True,
    )
    assert (off["prefix_caching"], off["prefix_caching_reason"]) == (False, "PREFIX_CACHE_MAX_MB is 0")


@pytest.mark.parametrize("path", ("serial", "batched"))
def test_a_window_past_the_first_turn_steers_the_rows_after_a_reused_prefix(engines, path):
    """A control whose window starts past the first turn's prompt: the turns whose prompts
    reach it are keyed by it, and a turn that reuses a stored prefix prefills the rest —
    rows inside the window among them — at their own positions, steered as the uncached
    run steers them."""
    on, off = engines[(path, True)], engines[(path, False)]
    spec = SteeringSpec([SteeringEntry(L1, 1, {}, [FeatureControl(3, value=12.0, window=PositionRange(60, 180))])])
    before = counters(on, "prompt_steered")
    cached = converse(on, f"{path}-window", steering=spec)
    after = counters(on, "prompt_steered")
    plain = converse(off, f"{path}-window", steering=spec)
    for got, want in zip(cached, plain):
        assert_same_generation(got, want)
    prompts = [r.usage.prompt_tokens for r in cached]
    assert prompts[0] + 6 < 60 < prompts[1] < 180 < prompts[-1], prompts  # the first turn's rows all before it
    # the turns after the second reused the steered KV their predecessor stored
    assert after["hits"] - before["hits"] >= len(TURNS) - 2
    # the window changes the answers: a run that left those rows unsteered would differ
    unsteered = converse(off, f"{path}-window")
    assert unsteered[0].token_ids == plain[0].token_ids
    assert any(
        u.token_ids != p.token_ids
        or np.abs(
            np.array([[e.logprob for e in t.top_logprobs] for t in u.logprobs])
            - np.array([[e.logprob for e in t.top_logprobs] for t in p.logprobs])
        ).max()
        > 1e-3
        for u, p in zip(unsteered[1:], plain[1:])
    )
