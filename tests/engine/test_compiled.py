"""Compiled decoding (TORCH_COMPILE) and the static KV cache (KV_CACHE_MODE) on the
transformers backend: the same greedy tokens, monitoring records and steering counts as
the eager model with the dynamic cache, which is the reference here (an engine loaded
without either option).  Compiling the tiny model takes tens of seconds, so each engine
is built once per module and the tests share its graphs."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

SAE = "tiny-llama-L1-relu"
MODEL_SAE = {"tiny-llama": SAE, "tiny-gemma2": "tiny-gemma2-L1-jumprelu", "tiny-gpt2": "tiny-gpt2-L1-relu"}
PROMPTS = [
    "the cat sat on the mat and",
    "one two three four five six seven",
    "a quick brown fox jumps over the lazy dog while the sun",
]


def _engine(tiny_assets, options: dict, *, attach: bool = True, batch: int = 0, model: str = "tiny-llama") -> Engine:
    asset = tiny_assets.models[model]
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=batch) if batch else None)
    eng.load_model(LoadModelJob(model, str(asset.path), dtype="float32", device="cpu", options=options))
    if attach:
        sae = tiny_assets.saes[MODEL_SAE[model]]
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    return eng


@pytest.fixture(scope="module")
def eager(tiny_assets):
    eng = _engine(tiny_assets, {})
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def compiled(tiny_assets):
    eng = _engine(tiny_assets, {"torch_compile": True})
    yield eng
    eng.shutdown()


def steering(tiny_assets, features=None, sae_name=SAE):
    sae = tiny_assets.saes[sae_name]
    return SteeringSpec.from_mapping({(sae.name, sae.layer): features or {3: 8.0, 17: -5.0}})


def monitor(tiny_assets, sae_name=SAE):
    sae = tiny_assets.saes[sae_name]
    return MonitorSpec(
        [
            MonitorEntry(
                sae.name,
                sae.layer,
                top_k=5,
                features=[0, 7, 100],
                read_point="post_steering",
                positions="all",
            )
        ]
    )


def job(rid: str, prompt: str, n: int, **kw) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        **kw,
    )


def same_records(got, ref) -> None:
    """Positions and top-k features equal, activations within float32 noise (compiled
    kernels sum in another order)."""
    assert [(r.position, [f.feature_index for f in r.top_k]) for r in got.activations] == [
        (r.position, [f.feature_index for f in r.top_k]) for r in ref.activations
    ]
    for a, b in zip(got.activations, ref.activations):
        assert [f.activation for f in (*a.top_k, *a.features)] == pytest.approx(
            [f.activation for f in (*b.top_k, *b.features)], rel=1e-4, abs=1e-4
        )


def test_compiled_decoding_gives_eager_tokens_activations_and_steering_counts(tiny_assets, eager, compiled):
    for i, prompt in enumerate(PROMPTS[:2]):
        kw = {"steering": steering(tiny_assets), "monitor": monitor(tiny_assets)}
        ref = eager.generate_sync(job(f"e{i}", prompt, 24, **kw))
        got = compiled.generate_sync(job(f"c{i}", prompt, 24, **kw))
        assert got.token_ids == ref.token_ids
        same_records(got, ref)
        # steering added at every forward pass: the prefill and each compiled step
        (count,) = got.steering_apply_count
        assert count.count == got.forward_passes == 24
        if i == 0:
            graphs = compiled.backend.capabilities().torch_compile_status["compiles"]
            assert graphs > 0
    # the second request, of another length, reused the graphs: no recompile as it grew
    caps = compiled.backend.capabilities()
    assert caps.torch_compile is True and caps.kv_cache_mode == "static"
    assert caps.torch_compile_status["compiles"] == graphs


def test_a_hook_installed_after_compilation_runs_at_every_step(tiny_assets, compiled):
    """A hook added to an already compiled model without any cache reset still runs at
    every forward pass: Dynamo guards the modules' hooks (the runner switches its
    nn-module hook guards on; torch 2.13 also guards them when it inlines ``_call_impl``)
    and recompiles or runs the frame as written, never the graph compiled without it."""
    compiled.generate_sync(job("warm", PROMPTS[0], 6))  # the graphs exist
    graphs = compiled.backend.capabilities().torch_compile_status["compiles"]
    block = compiled.backend.block(2)[0]
    calls = []
    handle = block.register_forward_hook(torch.compiler.disable(lambda m, a, o: calls.append(1)))
    try:
        res = compiled.generate_sync(job("late", PROMPTS[0], 10))
    finally:
        handle.remove()
    assert len(calls) == res.forward_passes == 10
    assert compiled.backend.capabilities().torch_compile_status["compiles"] >= graphs


def test_steering_attached_after_compilation_counts_every_forward_pass(tiny_assets, eager, compiled):
    """The engine's attach path: detach, compile without the SAE, attach it again — the
    steered request is steered at every forward pass and decodes as eager does."""
    sae = tiny_assets.saes[SAE]
    compiled.detach(None)
    compiled.generate_sync(job("bare", PROMPTS[2], 8))  # compiled without any hook
    before = compiled.backend.capabilities().torch_compile_status["cache_resets"]
    compiled.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    assert compiled.backend.capabilities().torch_compile_status["cache_resets"] == before + 1
    kw = {"steering": steering(tiny_assets, {40: -6.0, 41: 4.0})}
    got = compiled.generate_sync(job("steered", PROMPTS[2], 16, **kw))
    ref = eager.generate_sync(job("ref", PROMPTS[2], 16, **kw))
    assert got.token_ids == ref.token_ids
    (count,) = got.steering_apply_count
    assert count.count == got.forward_passes == 16
    (att,) = [a for a in compiled.attachments() if a.sae_id == sae.name]
    assert att.steering_apply_count == 16


@pytest.mark.parametrize("model", list(MODEL_SAE))
@pytest.mark.parametrize("batch", [0, 4])
def test_static_cache_gives_dynamic_cache_tokens_and_records(tiny_assets, model, batch):
    """KV_CACHE_MODE=static, eager: serial (a StaticCache) and batched (the slab stepped
    over its capacity, three requests padded to four rows) against the dynamic cache, on
    RoPE (Llama), sliding-window (Gemma 2) and learned-position (GPT-2) models."""
    dynamic = _engine(tiny_assets, {}, model=model)
    static = _engine(tiny_assets, {"kv_cache_mode": "static"}, batch=batch, model=model)
    try:
        assert static.backend.capabilities().kv_cache_mode == "static"
        kw = {
            "steering": steering(tiny_assets, sae_name=MODEL_SAE[model]),
            "monitor": monitor(tiny_assets, sae_name=MODEL_SAE[model]),
        }
        refs = [dynamic.generate_sync(job(f"e{i}", p, 20 + 5 * i, **kw)) for i, p in enumerate(PROMPTS)]
        got: list = [None] * len(PROMPTS)

        def run(i: int) -> None:
            got[i] = static.generate_sync(job(f"s{i}", PROMPTS[i], 20 + 5 * i, **kw))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for g, r in zip(got, refs):
            assert g.token_ids == r.token_ids
            same_records(g, r)
            (count,) = g.steering_apply_count
            assert count.count == g.forward_passes
    finally:
        static.shutdown()
        dynamic.shutdown()


def test_compiled_batch_recompiles_only_per_bucket_as_requests_join_and_leave(tiny_assets, eager):
    """Requests of different lengths join and leave a compiled batch of two rows: the
    tokens are each request's eager ones, and the graphs compiled stay at the row
    buckets (1 and 2) times the graphs of one step — not one per step."""
    batched = _engine(tiny_assets, {"torch_compile": True}, attach=False, batch=2)
    try:
        lengths = [30, 12, 22, 8]
        refs = [eager.generate_sync(job(f"e{i}", PROMPTS[i % 3], n)).token_ids for i, n in enumerate(lengths)]
        got: list = [None] * len(lengths)

        def run(i: int) -> None:
            got[i] = batched.generate_sync(job(f"b{i}", PROMPTS[i % 3], lengths[i])).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lengths))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert got == refs
        # no hook attached: one graph per row bucket, over at least 36 decode steps
        assert 1 <= batched.backend.capabilities().torch_compile_status["compiles"] <= 2
    finally:
        batched.shutdown()


def test_speculative_decoding_with_compile_or_static_cache_is_refused_at_load(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    eng = Engine()
    try:
        for extra in ({"torch_compile": True}, {"kv_cache_mode": "static"}):
            with pytest.raises(InvalidParameter) as err:
                eng.load_model(
                    LoadModelJob(
                        "tiny-llama",
                        str(asset.path),
                        dtype="float32",
                        device="cpu",
                        options={"speculative_model": "self:layers=2", **extra},
                    )
                )
            assert err.value.details["param"] == "options.speculative_model"
        with pytest.raises(InvalidParameter) as err:
            eng.load_model(
                LoadModelJob(
                    "tiny-llama",
                    str(asset.path),
                    dtype="float32",
                    device="cpu",
                    options={"kv_cache_mode": "paged"},
                )
            )
        assert err.value.details["param"] == "options.kv_cache_mode"
        assert eng.status().state == "empty"
    finally:
        eng.shutdown()
