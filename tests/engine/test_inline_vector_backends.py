"""Inline steering vectors on every backend that steers: on the demo SmolLM2-135M (the
same float32 weights on transformers, vLLM and llama.cpp, as tests/engine/
test_backend_parity.py loads them), a vector equal to ``10 · W_dec[0]`` of the demo SAE
(read from its files here) gives the tokens the transformers backend gives for feature 0
at strength 10, at every position and gated to the completion, in one concurrent batch;
and it changes them (positive control). A vector's clamp of its projection
(docs/steering.md, "Inline vectors"), at every position and gated to the completion,
gives in one concurrent batch the tokens of the transformers backend run alone (whose
rows tests/engine/test_vector_clamps.py checks against the test's own float64 formula),
and changes them.

Needs the demo package, vLLM and llama-cpp-python (``MILLM_REQUIRE_DEMO=1``,
``MILLM_REQUIRE_VLLM=1``, ``MILLM_REQUIRE_LLAMACPP=1`` fail instead of skipping)."""

from __future__ import annotations

import numpy as np

from gpu_engine.api.protocol import FeatureControl, GenerationJob, SteeringEntry, SteeringSpec
from gpu_engine.api.steering import SteeringVector

from .helpers import RefSAE
from .test_backend_parity import (  # noqa: F401 - demo is a fixture
    assert_every_backend_steers_as_alone,
    demo,
    demo_loads,
    greedy,
    solo_reference,
)

PROMPTS = {"vec": "My favourite place to visit is", "gated": "Tell me a story about a small town where"}


def test_an_inline_vector_gives_the_features_tokens_on_every_backend(demo):  # noqa: F811
    model, sae, gguf = demo
    row = (np.float32(10.0) * RefSAE(sae).W_dec[0].astype(np.float32)).astype(np.float32)
    key = (sae.name, sae.layer)
    as_features = {
        "vec": SteeringSpec([SteeringEntry(*key, {0: 10.0})]),
        "gated": SteeringSpec([SteeringEntry(*key, {}, [FeatureControl(0, value=10.0, phase="completion")])]),
    }
    ids, want, plain = solo_reference(demo_loads(model, gguf)[0], sae, PROMPTS, as_features)
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
    assert_every_backend_steers_as_alone(demo, jobs, want, plain)


CLAMP_PROMPTS = {"all": "My favourite place to visit is", "completion": "Tell me a story about a small town where"}


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
        for phase in CLAMP_PROMPTS
    }
    ids, want, plain = solo_reference(demo_loads(model, gguf)[0], sae, CLAMP_PROMPTS, clamps)
    jobs = {
        name: GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy(), steering=spec)
        for name, spec in clamps.items()
    }
    assert_every_backend_steers_as_alone(demo, jobs, want, plain)
