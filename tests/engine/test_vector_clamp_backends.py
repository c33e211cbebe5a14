"""A vector's clamp (docs/steering.md, "Inline vectors") on every backend that steers per
row: on the demo SmolLM2-135M (the same float32 weights on transformers, vLLM and
llama.cpp, as tests/engine/test_backend_parity.py loads them), a clamp of the projection
on the demo SAE's ``W_dec[0]`` (read from its files here), at every position and gated to
the completion, gives in one concurrent batch the tokens of the transformers backend run
alone (whose rows tests/engine/test_vector_clamps.py checks against the test's own
float64 formula), and changes them (positive control).

Needs the demo package, vLLM and llama-cpp-python (``MILLM_REQUIRE_DEMO=1``,
``MILLM_REQUIRE_VLLM=1``, ``MILLM_REQUIRE_LLAMACPP=1`` fail instead of skipping)."""

from __future__ import annotations

import gc

import numpy as np

from gpu_engine.api.protocol import AttachSpec, GenerationJob, LoadModelJob, SteeringEntry, SteeringSpec
from gpu_engine.api.steering import SteeringVector
from gpu_engine.runtime.engine import Engine

from .helpers import RefSAE
from .test_backend_parity import demo, greedy, run_batch  # noqa: F401 - fixture

PROMPTS = {"all": "My favourite place to visit is", "completion": "Tell me a story about a small town where"}


def test_a_clamp_gives_the_same_tokens_on_every_backend(demo):  # noqa: F811
    model, sae, gguf = demo
    row = RefSAE(sae).W_dec[0].astype(np.float32)
    value = float(10.0 * np.linalg.norm(row.astype(np.float64)))  # a floor far above the rows' own projections
    key = (sae.name, sae.layer)
    clamps = {
        phase: SteeringSpec(
            [
                SteeringEntry(
                    *key, {}, [], [SteeringVector(row.tobytes(), "float32", 0.8, phase, mode="clamp", min=value)]
                )
            ]
        )
        for phase in PROMPTS
    }
    hf_load = LoadModelJob(model.name, str(model.path), dtype="float32", device="cpu", max_context_length=512)
    hf = Engine()
    try:
        hf.load_model(hf_load)
        hf.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        ids = {name: hf.backend.encode_text(text) for name, text in PROMPTS.items()}
        want = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy(), steering=spec))
            for name, spec in clamps.items()
        }
        plain = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy())).token_ids
            for name in PROMPTS
        }
    finally:
        hf.shutdown()
        del hf
        gc.collect()
    jobs = {
        name: GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy(), steering=spec)
        for name, spec in clamps.items()
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
