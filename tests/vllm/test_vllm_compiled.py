"""The vLLM backend with its compiled graphs on (``VLLM_ENFORCE_EAGER=false``): vLLM traces
and compiles the model once at load, before any SAE is attached, so a Python hook added
to a layer afterwards would silently never run.  Our loader (gpu_engine/backends/vllm/
loader.py) taps every decoder layer and every Attention module before the trace
(gpu_engine/interp/taps.py), and the same hooks run through the taps.  Held to the
transformers backend on the same fp32 weights exactly as the eager backend is: a mixed
batch of every steering mode (tokens, per-mode ``steering_apply_count`` equal to the
forward passes — a hook the graph skipped counts 0 —, fired positions, monitored
activations), a steered hidden-state capture, and every layer's hidden states and Q/K
against the transformers backend and the Q/K reference; an SAE at each hook point inside
a layer and at the embeddings (resid_pre of 0, attn_out, mlp_out, a transcoder) through
the taps the loader put on those modules.  One compiled vLLM engine for the
module (its compile costs about a minute on two cores)."""

from __future__ import annotations

import pytest

from gpu_engine.api.protocol import BatchingOptions
from gpu_engine.runtime.engine import Engine

from .conftest import _attach, require_vllm, vllm_job
from .test_vllm_capture import (
    assert_capture_equals_transformers_and_the_qk_reference,
    assert_steered_capture_equals_transformers,
    hf_model,  # noqa: F401 - the module fixture the Q/K reference reads
)
from .test_vllm_hook_points import assert_hook_points_equal_transformers
from .test_vllm_steering_modes import assert_mixed_batch_equals_transformers


@pytest.fixture(scope="module")
def vllm_compiled(tiny_assets):
    require_vllm()
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=8), drain_timeout_s=300)
    eng.load_model(vllm_job(tiny_assets, distributed_executor_backend="uni", max_num_seqs=8, enforce_eager=False))
    _attach(eng, tiny_assets)
    yield eng
    eng.shutdown()


def test_compiled_reports_every_steering_and_capture_capability(vllm_compiled):
    caps = vllm_compiled.status().batching["capabilities"]
    assert caps["torch_compile"] is True and caps["cuda_graphs"] is False  # CPU: compiled, no graphs
    assert caps["per_request_steering"] is True and caps["steering_controls"] is True
    assert caps["per_request_monitoring"] is True
    assert caps["hidden_state_capture"] is True and caps["attention_capture"] is True


def test_compiled_a_mixed_batch_of_every_mode_equals_transformers(vllm_compiled, hf_engine):
    assert_mixed_batch_equals_transformers(vllm_compiled, hf_engine)


def test_compiled_a_steered_request_captures_its_steered_stream(vllm_compiled, hf_engine):
    assert_steered_capture_equals_transformers(vllm_compiled, hf_engine)


def test_compiled_capture_equals_transformers_and_the_qk_reference(vllm_compiled, hf_engine, hf_model):  # noqa: F811
    assert_capture_equals_transformers_and_the_qk_reference(vllm_compiled, hf_engine, hf_model)


def test_compiled_every_hook_point_steers_and_monitors_like_transformers(
    vllm_compiled, hf_engine, tiny_assets, tmp_path
):
    assert_hook_points_equal_transformers(vllm_compiled, hf_engine, tiny_assets, tmp_path)
