"""The prefix cache (PREFIX_CACHE_MAX_MB; docs/engine.md, "Prefix cache") on the
transformers backend, serial and batched: a multi-turn chat served with the cache gives
the very greedy tokens (and monitoring records, within float tolerance) of the same chat
with the cache off, each turn prefills only what no stored sequence covers (counted by
the test's own hook on the embedding: the prefill's width), and steering that touches
the prompt never meets KV computed without it (nor the reverse)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    CaptureSpec,
    FeatureControl,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.decode.prefix_cache import PrefixCache
from gpu_engine.runtime.engine import Engine

from .tolerances import CAPTURE_ATOL, CAPTURE_RTOL, ENCODE_ATOL, ENCODE_RTOL

SAE = "tiny-llama-L1-relu"
MODES = ["serial", "batched"]
QUESTIONS = ["tell me about foxes", "and about dogs?", "which one is faster", "thanks, one more"]


def _engine(tiny_assets, mode: str, mb: int, model: str = "tiny-llama", **options) -> Engine:
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4) if mode == "batched" else None)
    asset = tiny_assets.models[model]
    options = {"prefix_cache_max_mb": mb, **options}
    eng.load_model(LoadModelJob(model, str(asset.path), dtype="float32", device="cpu", options=options))
    return eng


@pytest.fixture(scope="module")
def engines(tiny_assets):
    made: dict[tuple[str, int, str], Engine] = {}

    def get(mode: str, mb: int, model: str = "tiny-llama") -> Engine:
        key = (mode, mb, model)
        if key not in made:
            made[key] = _engine(tiny_assets, mode, mb, model)
        return made[key]

    yield get
    for eng in made.values():
        eng.shutdown()


def fresh(eng: Engine, tiny_assets) -> Engine:
    """``eng`` with ``SAE`` attached anew (which empties its prefix cache)."""
    asset = tiny_assets.saes[SAE]
    eng.detach(None)
    eng.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    return eng


def figures(eng: Engine) -> dict:
    return eng.status().memory["prefix_cache"]


def counts(eng: Engine) -> dict[str, dict[str, int]]:
    return {k: {n: v for n, v in c.items() if n != "hit_rate"} for k, c in figures(eng)["classes"].items()}


def since(eng: Engine, before: dict, kind: str) -> dict[str, int]:
    """What ``kind``'s counters advanced by since ``before`` (``counts``)."""
    return {n: v - before[kind][n] for n, v in counts(eng)[kind].items()}


@contextmanager
def prefill_widths(eng: Engine):
    """The width (tokens) of every forward's input, by the test's own embedding hook."""
    widths: list[int] = []
    emb = eng.backend.model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda mod, args, out: widths.append(int(args[0].shape[-1])))
    try:
        yield widths
    finally:
        handle.remove()


def turn_job(rid: str, messages, *, max_tokens: int = 5, **kwargs) -> GenerationJob:
    return GenerationJob(
        rid,
        messages=list(messages),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        **kwargs,
    )


def chat(eng: Engine, turns: int = 4, **kwargs) -> tuple[list, list[int]]:
    """A chat resent whole each turn (as Open WebUI does); returns each turn's result and
    the width of each turn's first forward (its prefill)."""
    messages: list[dict] = []
    results, first = [], []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        with prefill_widths(eng) as widths:
            out = eng.generate_sync(turn_job(f"t{t}", messages, **kwargs))
        results.append(out)
        first.append(widths[0])
        messages.append({"role": "assistant", "content": out.text})
    return results, first


def steering(*controls: FeatureControl, features=None) -> SteeringSpec:
    return SteeringSpec([SteeringEntry(SAE, 1, dict(features or {}), list(controls))])


PROMPT_STEERED = {"features": {5: 3.0, 9: -2.0}}
DECODE_ONLY = {"controls": [FeatureControl(5, "add", 4.0, phase="completion")]}


def spec_of(kind: str) -> SteeringSpec | None:
    if kind == "unsteered":
        return None
    if kind == "prompt_steered":
        return steering(features=PROMPT_STEERED["features"])
    return steering(*DECODE_ONLY["controls"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["unsteered", "prompt_steered", "decode_only"])
def test_a_chat_gives_the_same_tokens_with_the_cache_and_prefills_less(engines, tiny_assets, mode, kind):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    expected, full = chat(off, steering=spec_of(kind))
    before = counts(on)
    got, widths = chat(on, steering=spec_of(kind))
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.usage.prompt_tokens for r in got] == [r.usage.prompt_tokens for r in expected]
    # without the cache each turn prefills its whole prompt; with it, turns after the first
    # prefill only what the previous turns did not hold
    assert full == [r.usage.prompt_tokens for r in expected]
    assert widths[0] == full[0]
    assert all(w < f for w, f in zip(widths[1:], full[1:]))
    c = since(on, before, kind)
    assert c["lookups"] == 4 and c["hits"] == 3
    assert c["tokens_reused"] == sum(f - w for f, w in zip(full, widths))


@pytest.mark.parametrize("mode", MODES)
def test_prompt_steered_and_unsteered_never_share_kv(engines, tiny_assets, mode):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    steered = spec_of("prompt_steered")
    # an unsteered turn is stored; the same conversation steered must not reuse it
    on.generate_sync(turn_job("u", messages))
    before = counts(on)
    with prefill_widths(on) as widths:
        got = on.generate_sync(turn_job("s", messages, steering=steered))
    assert widths[0] == got.usage.prompt_tokens
    assert got.token_ids == off.generate_sync(turn_job("s", messages, steering=steered)).token_ids
    c = since(on, before, "prompt_steered")
    assert c["lookups"] == 1 and c["hits"] == 0
    # and the reverse: the steered entry is not reused by an unsteered request
    fresh(on, tiny_assets)
    on.generate_sync(turn_job("s2", messages, steering=steered))
    before = counts(on)
    with prefill_widths(on) as widths:
        plain = on.generate_sync(turn_job("u2", messages))
    assert widths[0] == plain.usage.prompt_tokens
    assert plain.token_ids == off.generate_sync(turn_job("u2", messages)).token_ids
    assert since(on, before, "unsteered") == {"lookups": 1, "hits": 0, "tokens_reused": 0, "bypassed": 0}
    # other strengths are another key: no hit either
    with prefill_widths(on) as widths:
        on.generate_sync(turn_job("s3", messages, steering=steering(features={5: 3.5, 9: -2.0})))
    assert widths[0] == plain.usage.prompt_tokens


def decode_only_kinds(n_prompt: int) -> dict[str, SteeringSpec]:
    """Steering that leaves every prompt row alone: gated to the completion, or a window
    that starts where the prompt ends."""
    return {
        "phase": steering(FeatureControl(5, "add", 4.0, phase="completion")),
        "window": steering(FeatureControl(5, "add", 4.0, window={"start": n_prompt})),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["phase", "window"])
def test_decode_only_steering_reuses_unsteered_prompt_kv(engines, tiny_assets, mode, kind):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    n_prompt = len(on.backend.encode_messages(messages, add_generation_prompt=True))
    spec = decode_only_kinds(n_prompt)[kind]
    on.generate_sync(turn_job("u", messages))
    before = counts(on)
    with prefill_widths(on) as widths:
        got = on.generate_sync(turn_job("d", messages, steering=spec))
    assert widths[0] == 1  # all but the last prompt token came from the unsteered entry
    want = off.generate_sync(turn_job("d", messages, steering=spec))
    assert got.token_ids == want.token_ids
    # positive control: the steering does change the answer
    assert want.token_ids != off.generate_sync(turn_job("plain", messages)).token_ids
    assert since(on, before, "decode_only")["hits"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_window_reaching_into_the_prompt_or_a_condition_is_not_decode_only(engines, tiny_assets, mode):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    n_prompt = len(on.backend.encode_messages(messages, add_generation_prompt=True))
    on.generate_sync(turn_job("u", messages))
    # a window starting on the prompt's last row steers that row: its own key, no hit
    reaching = steering(FeatureControl(5, "add", 4.0, window={"start": n_prompt - 1}))
    # a conditional control recomputes its prompt (its gate reports where it fired)
    conditional = steering(FeatureControl(5, "add", 4.0, phase="completion", condition={"feature": 7}))
    for spec in (reaching, conditional):
        with prefill_widths(on) as widths:
            got = on.generate_sync(turn_job("w", messages, steering=spec))
        assert widths[0] == n_prompt
        assert got.token_ids == off.generate_sync(turn_job("w", messages, steering=spec)).token_ids


@pytest.mark.parametrize("mode", MODES)
def test_namespaces_keep_entries_apart(engines, tiny_assets, mode):
    on = fresh(engines(mode, 64), tiny_assets)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    on.generate_sync(turn_job("a", messages, cache_namespace="alice"))
    for namespace, reused in (("bob", False), (None, False), ("alice", True)):
        with prefill_widths(on) as widths:
            out = on.generate_sync(turn_job("b", messages, cache_namespace=namespace))
        assert (widths[0] < out.usage.prompt_tokens) is reused, namespace


@pytest.mark.parametrize("mode", MODES)
def test_monitored_chat_records_match_the_uncached_ones(engines, tiny_assets, mode):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    monitor = MonitorSpec([MonitorEntry(SAE, 1, top_k=5, features=[0, 7, 100], positions="completion")])
    expected, _ = chat(off, 3, monitor=monitor)
    got, widths = chat(on, 3, monitor=monitor)
    assert widths[2] < got[2].usage.prompt_tokens  # the monitored turns did hit
    for a, b in zip(got, expected):
        assert a.token_ids == b.token_ids
        assert [(r.position, r.token_index) for r in a.activations] == [
            (r.position, r.token_index) for r in b.activations
        ]
        for ra, rb in zip(a.activations, b.activations):
            assert [f.feature_index for f in ra.features] == [f.feature_index for f in rb.features]
            np.testing.assert_allclose(
                [f.activation for f in ra.features],
                [f.activation for f in rb.features],
                atol=ENCODE_ATOL,
                rtol=ENCODE_RTOL,
            )


@pytest.mark.parametrize("mode", MODES)
def test_requests_that_read_prompt_rows_recompute_every_position(engines, tiny_assets, mode):
    off = fresh(engines(mode, 0), tiny_assets)
    on = fresh(engines(mode, 64), tiny_assets)
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    on.generate_sync(turn_job("warm", messages))  # stored: a lookup would hit
    before = counts(on)
    monitor = MonitorSpec([MonitorEntry(SAE, 1, features=[0, 7], positions="prompt")])
    cap = CaptureSpec(layers=[1], positions="prompt")
    for kwargs in ({"monitor": monitor}, {"capture": cap}):
        with prefill_widths(on) as widths:
            got = on.generate_sync(turn_job("p", messages, **kwargs))
        want = off.generate_sync(turn_job("p", messages, **kwargs))
        assert widths[0] == got.usage.prompt_tokens  # the whole prompt, recomputed
        assert got.token_ids == want.token_ids
        if "monitor" in kwargs:
            assert [r.position for r in got.activations] == list(range(got.usage.prompt_tokens))
            np.testing.assert_allclose(
                [f.activation for r in got.activations for f in r.features],
                [f.activation for r in want.activations for f in r.features],
                atol=ENCODE_ATOL,
                rtol=ENCODE_RTOL,
            )
        else:
            a, b = load_capture(got.capture.data), load_capture(want.capture.data)
            assert a.positions.tolist() == b.positions.tolist() == list(range(got.usage.prompt_tokens))
            np.testing.assert_allclose(a.hidden[1], b.hidden[1], atol=CAPTURE_ATOL, rtol=CAPTURE_RTOL)
    assert since(on, before, "unsteered")["bypassed"] == 2
    # after them, a plain request still reuses what is stored
    with prefill_widths(on) as widths:
        on.generate_sync(turn_job("again", messages))
    assert widths[0] == 1


def test_a_sliding_window_model_gives_the_same_chat(engines, tiny_assets):
    expected, _ = chat(engines("batched", 0, "tiny-gemma2"), 3)
    got, widths = chat(engines("batched", 64, "tiny-gemma2"), 3)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert widths[2] < got[2].usage.prompt_tokens


@pytest.mark.parametrize("mode", MODES)
def test_the_static_kv_cache(tiny_assets, mode):
    """KV_CACHE_MODE=static: the batch's fixed slab takes cached rows like any prefill; the
    serial path's StaticCache does not use the prefix cache (it prefills every prompt)."""
    made = [_engine(tiny_assets, mode, mb, kv_cache_mode="static") for mb in (0, 64)]
    try:
        expected, full = chat(made[0], 3)
        got, widths = chat(made[1], 3)
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        if mode == "batched":
            assert all(w < f for w, f in zip(widths[1:], full[1:]))
        else:
            assert widths == full
            caps = made[1].status().batching["capabilities"]
            assert "static KV cache" in caps["prefix_caching_reason"]
    finally:
        for eng in made:
            eng.shutdown()


def ids_job(rid: str, ids: list[int]) -> GenerationJob:
    return GenerationJob(rid, prompt_token_ids=ids, sampling=SamplingParams(max_tokens=5, temperature=0.0))


def test_the_budget_bounds_the_bytes_held(tiny_assets):
    eng = _engine(tiny_assets, "batched", 1)
    try:
        # prompts of 400 tokens that share no first token (~0.4 MiB of KV each)
        body = [(j * 7) % 400 + 50 for j in range(399)]
        prompts = [[10 + i, *body] for i in range(8)]
        for i, ids in enumerate(prompts):
            eng.generate_sync(ids_job(f"l{i}", ids))
            f = figures(eng)
            assert f["bytes"] <= f["budget_bytes"] == 1024 * 1024
        assert f["evictions"] > 0 and f["entries"] >= 1
        # the most recent one is still there (all but one token reused); the first was evicted
        for i, width in ((7, 1), (0, 400)):
            with prefill_widths(eng) as widths:
                eng.generate_sync(ids_job(f"r{i}", prompts[i]))
            assert widths[0] == width
        # an unload and a load start from an empty cache
        eng.unload_model()
        asset = tiny_assets.models["tiny-llama"]
        opts = {"prefix_cache_max_mb": 1}
        eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu", options=opts))
        assert figures(eng)["entries"] == 0
        with prefill_widths(eng) as widths:
            eng.generate_sync(ids_job("after", prompts[7]))
        assert widths[0] == 400
    finally:
        eng.shutdown()


def test_off_reports_no_cache_in_capabilities(engines):
    caps = engines("serial", 0).status().batching["capabilities"]
    assert caps["prefix_caching"] is False and "PREFIX_CACHE_MAX_MB" in caps["prefix_caching_reason"]
    assert engines("serial", 64).status().batching["capabilities"]["prefix_caching"] is True


def test_lru_eviction_by_bytes():
    cache = PrefixCache(1000)
    for i in range(5):
        assert cache.store(namespace=None, key="", tokens=[i, 1, 2], payload=i, nbytes=300)
        assert cache.nbytes <= 1000
    assert len(cache) == 3
    # the oldest went first; a lookup refreshes an entry
    assert cache.lookup(namespace=None, key="", tokens=[0, 1, 2, 3], klass="unsteered") is None
    assert cache.lookup(namespace=None, key="", tokens=[2, 1, 2, 3], klass="unsteered").length == 3
    cache.store(namespace=None, key="", tokens=[9, 9], payload=9, nbytes=300)
    assert cache.lookup(namespace=None, key="", tokens=[2, 1, 2, 3], klass="unsteered") is not None
    assert cache.lookup(namespace=None, key="", tokens=[3, 1, 2, 3], klass="unsteered") is None
    # larger than the budget: not kept; a prompt is never reused whole (one token left)
    assert not cache.store(namespace=None, key="", tokens=[7], payload=7, nbytes=1001)
    assert cache.lookup(namespace=None, key="", tokens=[2, 1, 2], klass="unsteered").length == 2
