"""What the monitor tests on the demo SmolLM2-135M share (test_fidelity_monitor.py,
test_packed_monitor.py): the demo model and its SAE, the test's own float32 transformers
forward of the checkpoint, the prompts, and an engine of a given backend with the SAE
attached, shut down and freed after its one concurrent batch."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    MonitorSpec,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.runtime.engine import Engine
from tests.fixtures.backends import require_backend
from tests.fixtures.llamacpp import gguf_copy

from .test_backend_parity import demo_loads

N_TOKENS = 6
STEER = 10.0  # the demo SAE's feature 0 ("ocean"), in its documented working range
LONG = (
    "The river ran past the old mill, where the miller's daughter counted sacks of flour "
    "and wrote the numbers in a ledger that her grandfather had bound in leather. "
)
BACKENDS = ["transformers-serial", "transformers", "vllm", "llamacpp"]


@pytest.fixture(scope="module")
def demo(demo_assets):
    from offline_assets import DEMO_MODEL_NAME, DEMO_SAE_NAME

    return demo_assets.models[DEMO_MODEL_NAME], demo_assets.saes[DEMO_SAE_NAME]


@pytest.fixture(scope="module")
def reference(demo):
    """The checkpoint in float32 (plain transformers, no engine): block ``layer``'s output
    over any token ids, float64."""
    model, sae = demo
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), torch_dtype=torch.float32)
    hf.eval()

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[sae.layer + 1][0].double().numpy()  # block L's output

    return hidden


def steered_job(
    rid: str, ids: list[int], sampling: SamplingParams, key: tuple[str, int], monitor: MonitorSpec
) -> GenerationJob:
    """A request steered by STEER on the SAE's feature 0 at its layer, monitored by ``monitor``."""
    steering = SteeringSpec([SteeringEntry(*key, {0: STEER})])
    return GenerationJob(rid, prompt_token_ids=ids, sampling=sampling, steering=steering, monitor=monitor)


@contextmanager
def demo_engine(backend: str, model: Any, sae_asset: Any) -> Iterator[Engine]:
    """An engine of ``backend`` (vLLM and llama.cpp required where the environment says
    so) with the demo loaded in float32 and its SAE attached; shut down and freed after."""
    if backend in ("vllm", "llamacpp"):
        require_backend(backend)
    gguf = gguf_copy(Path(model.path)) if backend == "llamacpp" else None
    hf_load, vllm_load, gguf_load = demo_loads(model, gguf)
    load = {"vllm": vllm_load, "llamacpp": gguf_load}.get(backend, hf_load)
    batching = BatchingOptions(enabled=backend != "transformers-serial", max_batch_size=8)
    eng = Engine(batching=batching, drain_timeout_s=300)
    try:
        eng.load_model(load)
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        yield eng
    finally:
        eng.shutdown()
        del eng
        gc.collect()
