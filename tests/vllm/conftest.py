"""vLLM backend fixtures: one vLLM engine per test module (its start costs ~40 s on two
cores, mostly importing vLLM), and a transformers engine on the same weights as the
reference.  Where vllm is not installed the tests skip — unless ``MILLM_REQUIRE_VLLM=1``
(scripts/test sets it in CI, after ``scripts/setup vllm``), where they fail."""

from __future__ import annotations

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import AttachSpec, BatchingOptions, LoadModelJob
from tests.fixtures.backends import require_backend

# the SAEs every vLLM test engine carries: two layouts, three layers
SAES = ("tiny-llama-L1-relu", "tiny-llama-L2-jumprelu", "tiny-llama-L3-relu")


def require_vllm() -> None:
    require_backend("vllm")


def vllm_job(tiny_assets, **options) -> LoadModelJob:
    """tiny-llama on vLLM, float32 on the CPU, with vLLM's ``options``."""
    return LoadModelJob(
        "tiny-llama",
        str(tiny_assets.models["tiny-llama"].path),
        dtype="float32",
        device="cpu",
        backend="vllm",
        options=options,
    )


def _attach(eng: Engine, tiny_assets) -> None:
    eng.attach_set([AttachSpec(name, str(tiny_assets.saes[name].path), tiny_assets.saes[name].layer) for name in SAES])


@pytest.fixture(scope="module")
def vllm_engine(tiny_assets):
    """tiny-llama on vLLM (float32, eager, engine core and worker in this process), the
    SAEs attached; the engine's batch holds 8 requests."""
    require_vllm()
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=8), drain_timeout_s=300)
    eng.load_model(vllm_job(tiny_assets, distributed_executor_backend="uni", max_num_seqs=8))
    _attach(eng, tiny_assets)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf_engine(tiny_assets):
    """The same weights and SAEs on the transformers backend (serial): the reference."""
    eng = Engine()
    asset = tiny_assets.models["tiny-llama"]
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu"))
    _attach(eng, tiny_assets)
    yield eng
    eng.shutdown()
