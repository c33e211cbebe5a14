"""vLLM blocks that return the residual stream itself (GPT-2), not vLLM's Llama-family
``(hidden, residual)`` pair: steering, monitoring and capture on tiny-gpt2 equal the
transformers backend on the same weights. The pair-only hooks once crashed vLLM's worker
on the first steered request (the engine then died)."""

from __future__ import annotations

import pytest

from gpu_engine.artifacts import load_capture
from gpu_engine.engine import Engine
from gpu_engine.protocol import AttachSpec, LoadModelJob, MonitorEntry

from .conftest import require_vllm
from .test_vllm_capture import close, job, worst
from .test_vllm_engine import assert_records_close, check_steered

SAE = "tiny-gpt2-L1-relu"


@pytest.fixture(scope="module")
def engines(tiny_assets):
    require_vllm()
    asset, sae = tiny_assets.models["tiny-gpt2"], tiny_assets.saes[SAE]
    vllm = Engine(drain_timeout_s=300)
    vllm.load_model(LoadModelJob("tiny-gpt2", str(asset.path), dtype="float32", device="cpu",
                                 backend="vllm", options={"distributed_executor_backend": "uni"}))
    hf = Engine()
    hf.load_model(LoadModelJob("tiny-gpt2", str(asset.path), dtype="float32", device="cpu"))
    for eng in (vllm, hf):
        eng.attach(AttachSpec(SAE, str(sae.path), sae.layer))
    yield vllm, hf, sae.layer
    vllm.shutdown()
    hf.shutdown()


def test_gpt2_steering_monitoring_and_capture_equal_transformers(engines):
    from gpu_engine.protocol import CaptureSpec

    vllm, hf, layer = engines
    steering = {(SAE, layer): {3: 8.0, 17: -5.0}}
    monitor = [MonitorEntry(SAE, layer, top_k=4, features=[3, 17], read_point="pre_steering",
                            positions="all")]
    spec = CaptureSpec(layers=[0, layer], positions="all")
    plain = vllm.generate_sync(job("plain", n=8))
    got = vllm.generate_sync(job("s", spec, steering=steering, monitor=monitor, n=8))
    want = hf.generate_sync(job("s", spec, steering=steering, monitor=monitor, n=8))
    assert got.token_ids == want.token_ids
    check_steered(got, plain)
    assert_records_close(got.activations, want.activations)
    a, b = load_capture(got.capture.data), load_capture(want.capture.data)
    for captured in (0, layer):
        assert close(a.hidden[captured], b.hidden[captured]), worst(a.hidden[captured],
                                                                    b.hidden[captured])
