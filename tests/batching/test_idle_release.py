"""TRANSFORMERS_IDLE_CACHE_RELEASE_S at the engine: the batched KV cache stays at the
largest batch × context it has held, and an idle engine hands it back to the system.

Measured as an operator would: the process's resident memory (``VmRSS``), against the KV
bytes the test computes from the model's own config. The model is built here, wider than
the shared tiny ones (whose KV cache is too small to see in the RSS)."""

from __future__ import annotations

import shutil
import time

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import BatchingOptions, GenerationJob, LoadModelJob, SamplingParams

ROWS = 12
PROMPT_TOKENS = 1400
KV_HEADS, HEAD_DIM, LAYERS = 8, 32, 2


@pytest.fixture(scope="module")
def wide_llama(tiny_assets, tmp_path_factory):
    """A 2-layer Llama with 8 KV heads (4 KiB of float32 KV a token) and a 4,096-token
    window, on the tiny tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tiny_assets.models["tiny-llama"].path
    out = tmp_path_factory.mktemp("wide-llama")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    base = LlamaConfig.from_pretrained(src)
    config = LlamaConfig(
        hidden_size=KV_HEADS * HEAD_DIM,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def kv_bytes_at_least(rows: int, tokens: int) -> int:
    # keys and values, float32, for every row's tokens: the slab holds at least this
    return rows * tokens * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4


def engine(path, idle_release_s):
    events: list[tuple[float, str]] = []
    eng = Engine(
        on_event=lambda e: events.append((time.monotonic(), e.name)),
        batching=BatchingOptions(enabled=True, max_batch_size=ROWS),
        idle_release_s=idle_release_s,
    )
    eng.load_model(LoadModelJob("wide-llama", str(path), dtype="float32", device="cpu"))
    return eng, events


def releases(events) -> int:
    return [n for _, n in events].count("memory:released")


def wait_releases(events, n: int, timeout_s: float = 30.0) -> None:
    """Until the engine has released ``n`` times (the idle period, plus however long a
    loaded machine takes to get there)."""
    deadline = time.monotonic() + timeout_s
    while releases(events) < n:
        assert time.monotonic() < deadline, f"{releases(events)} releases, wanted {n}"
        time.sleep(0.05)


def run_batch(eng, n_tokens: int = 40) -> None:
    # long enough that every row is still running when the last one is admitted
    greedy = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    jobs = [
        GenerationJob(f"r{i}", sampling=greedy, prompt_token_ids=[5 + (i + t) % 50 for t in range(PROMPT_TOKENS)])
        for i in range(ROWS)
    ]
    streams = [eng.generate(j) for j in jobs]
    for s in streams:
        assert s.result(120).finish_reason == "length"


def test_an_idle_engine_returns_the_kv_cache_to_the_system(wide_llama):
    eng, events = engine(wide_llama, 1.0)
    try:
        run_batch(eng)  # warm: allocator pools, code paths
        wait_releases(events, 1)
        before = rss()
        run_batch(eng)
        held = rss()
        kv = kv_bytes_at_least(ROWS, PROMPT_TOKENS)
        # the finished batch's KV slab is still held (kept for the next batch)
        assert held - before >= 0.8 * kv, (before, held, kv)
        wait_releases(events, 2)  # idle past TRANSFORMERS_IDLE_CACHE_RELEASE_S
        after = rss()
        assert held - after >= 0.8 * kv, (held, after, kv)
        # the next batch reserves it again
        run_batch(eng)
        assert rss() - after >= 0.8 * kv
    finally:
        eng.shutdown()


def test_the_release_never_runs_during_a_request_and_a_request_cancels_it(wide_llama):
    eng, events = engine(wide_llama, 1.0)
    try:
        run_batch(eng)
        # a request arrives before the idle period ends and runs past it
        time.sleep(0.2)
        started = time.monotonic()
        job = GenerationJob(
            "long",
            prompt_token_ids=[7] * 64,
            sampling=SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True),
        )
        eng.generate(job).result(300)
        ended = time.monotonic()
        assert ended - started > 1.0, "the request must outlast the idle period"
        wait_releases(events, 1)  # the engine went idle after the request and released
        released = [t for t, n in events if n == "memory:released"]
        # none before or during the request: it arrived first and cancelled the release
        assert len(released) == 1 and released[0] >= ended + 0.9, (started, ended, released)
    finally:
        eng.shutdown()


def test_a_negative_period_never_releases(wide_llama):
    eng, events = engine(wide_llama, None)  # TRANSFORMERS_IDLE_CACHE_RELEASE_S < 0
    try:
        run_batch(eng)
        held = rss()
        time.sleep(1.5)
        assert "memory:released" not in [n for _, n in events]
        assert held - rss() < 0.5 * kv_bytes_at_least(ROWS, PROMPT_TOKENS)
    finally:
        eng.shutdown()


def test_the_setting_reaches_the_engine(settings):
    """Cut the wiring and this fails: the embedded engine is built with the setting."""
    from core.engine_client import EmbeddedEngineClient

    settings.TRANSFORMERS_IDLE_CACHE_RELEASE_S = 2.5
    client = EmbeddedEngineClient()
    try:
        assert client.engine.idle_release_s == 2.5
    finally:
        client.engine.shutdown()
    settings.TRANSFORMERS_IDLE_CACHE_RELEASE_S = -1
    client = EmbeddedEngineClient()
    try:
        assert client.engine.idle_release_s is None
    finally:
        client.engine.shutdown()
