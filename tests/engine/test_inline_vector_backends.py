"""Inline steering vectors on every backend that steers: on the demo SmolLM2-135M (the
same float32 weights on transformers, vLLM and llama.cpp, as tests/engine/
test_backend_parity.py loads them), a vector equal to ``10 · W_dec[0]`` of the demo SAE
(read from its files here) gives the tokens the transformers backend gives for feature 0
at strength 10, at every position and gated to the completion, in one concurrent batch;
and it changes them (positive control).

Needs the demo package, vLLM and llama-cpp-python (``MILLM_REQUIRE_DEMO=1``,
``MILLM_REQUIRE_VLLM=1``, ``MILLM_REQUIRE_LLAMACPP=1`` fail instead of skipping)."""

from __future__ import annotations

import gc

import numpy as np

from gpu_engine.api.protocol import (
    AttachSpec,
    FeatureControl,
    GenerationJob,
    LoadModelJob,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.api.steering import SteeringVector
from gpu_engine.runtime.engine import Engine

from .helpers import RefSAE
from .test_backend_parity import demo, greedy, run_batch  # noqa: F401 - fixture

PROMPTS = {"vec": "My favourite place to visit is", "gated": "Tell me a story about a small town where"}


def test_an_inline_vector_gives_the_features_tokens_on_every_backend(demo):  # noqa: F811
    model, sae, gguf = demo
    row = (np.float32(10.0) * RefSAE(sae).W_dec[0].astype(np.float32)).astype(np.float32)
    key = (sae.name, sae.layer)
    hf_load = LoadModelJob(model.name, str(model.path), dtype="float32", device="cpu", max_context_length=512)
    hf = Engine()
    try:
        hf.load_model(hf_load)
        hf.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        ids = {name: hf.backend.encode_text(text) for name, text in PROMPTS.items()}
        as_features = {
            "vec": SteeringSpec([SteeringEntry(*key, {0: 10.0})]),
            "gated": SteeringSpec([SteeringEntry(*key, {}, [FeatureControl(0, value=10.0, phase="completion")])]),
        }
        want = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy(), steering=spec))
            for name, spec in as_features.items()
        }
        plain = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy())).token_ids
            for name in PROMPTS
        }
    finally:
        hf.shutdown()
        del hf
        gc.collect()
    vectors = {
        "vec": SteeringVector(row.tobytes(), "float32", 1.0),
        "gated": SteeringVector(row.tobytes(), "float32", 1.0, "completion"),
    }
    jobs = {
        name: GenerationJob(
            name,
            prompt_token_ids=ids[name],
            sampling=greedy(),
            steering=SteeringSpec([SteeringEntry(*key, {}, [], [v])]),
        )
        for name, v in vectors.items()
    }
    results = {"transformers": run_batch(hf_load, sae, jobs)}
    results["vllm"] = run_batch(
        LoadModelJob(
            model.name,
            str(model.path),
            dtype="float32",
            device="cpu",
            backend="vllm",
            max_context_length=512,
            options={"distributed_executor_backend": "uni", "max_num_seqs": 8, "enforce_eager": True},
        ),
        sae,
        jobs,
    )
    results["llamacpp"] = run_batch(
        LoadModelJob(
            model.name,
            str(gguf),
            device="cpu",
            backend="llamacpp",
            max_context_length=512,
            options={"kv_cache_type": "f32", "flash_attention": False},
        ),
        sae,
        jobs,
        steering_mode="eval_callback_per_row",
    )
    for backend, got in results.items():
        for name in PROMPTS:
            assert got[name].token_ids == want[name].token_ids, (backend, name)
            assert got[name].token_ids != plain[name], (backend, name)
            (applied,) = got[name].steering_apply_count
            assert applied.count == got[name].forward_passes, (backend, name)
