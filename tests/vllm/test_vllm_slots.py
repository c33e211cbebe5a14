"""The engine's interactive rows on vLLM (issue 33, item 4): left to the backend
(``BatchingOptions.follow_backend``: MAX_CONCURRENT_REQUESTS unset) a model on vLLM gets its
``max_num_seqs`` rows — that many generations run in one vLLM step — and a model on another
backend loaded after it the engine's own again; set by the operator (``max_batch_size``) it
is capped by vLLM's batch. /v1's side (admission, /api/health) is tests/v1/test_vllm_backend.py."""

from __future__ import annotations

import contextlib
import threading
import time

from gpu_engine.api.protocol import BatchingOptions, GenerationJob, LoadModelJob, SamplingParams
from gpu_engine.runtime.engine import Engine
from tests.vllm.conftest import require_vllm, vllm_job

PROMPT = "the cat sat on the mat and"


def _load_vllm(eng: Engine, tiny_assets, max_num_seqs: int) -> None:
    eng.load_model(vllm_job(tiny_assets, distributed_executor_backend="uni", max_num_seqs=max_num_seqs))


def _job(rid: str) -> GenerationJob:
    return GenerationJob(rid, prompt=PROMPT, sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


@contextlib.contextmanager
def _held(eng: Engine, rows: int):
    """The first vLLM step waits until the engine has accepted ``rows`` generations; the
    step after which ``rows`` run at once sets ``full`` and blocks until ``go``."""
    batch = eng._scheduler.backend
    step = batch.step
    full, go = threading.Event(), threading.Event()
    first = [True]

    def gated():
        if first[0]:
            first[0] = False
            deadline = time.monotonic() + 120
            while eng._ledger.live() < rows and time.monotonic() < deadline:
                time.sleep(0.005)
        finished = step()
        if not full.is_set() and len(eng._scheduler.running) >= rows:
            full.set()
            go.wait(300)
        return finished

    batch.step = gated
    try:
        yield full, go
    finally:
        go.set()
        del batch.step


def test_rows_follow_max_num_seqs_and_come_back_for_another_backend(tiny_assets):
    require_vllm()
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=1, follow_backend=True), drain_timeout_s=300)
    try:
        assert eng.status().batching["max_batch_size"] == 1  # nothing loaded: the engine's own
        _load_vllm(eng, tiny_assets, max_num_seqs=4)
        assert eng.status().batching["max_batch_size"] == 4
        with _held(eng, 4) as (full, go):
            streams = [eng.generate(_job(f"r{i}")) for i in range(4)]
            assert full.wait(300), "the four generations never ran in one vLLM step"
            batching = eng.status().batching
            assert (batching["running"], batching["waiting"]) == (4, 0)
            go.set()
            results = [s.result(300) for s in streams]
        assert len({tuple(r.token_ids) for r in results}) == 1 and len(results[0].token_ids) == 8
        # a transformers model (no batch of its own) gets the engine's one row again
        eng.load_model(
            LoadModelJob("tiny-llama", str(tiny_assets.models["tiny-llama"].path), dtype="float32", device="cpu")
        )
        assert eng.status().backend == "transformers"
        assert eng.status().batching["max_batch_size"] == 1
    finally:
        eng.shutdown()


def test_a_set_max_batch_size_is_capped_by_max_num_seqs(tiny_assets):
    """MAX_CONCURRENT_REQUESTS=6 with VLLM_MAX_NUM_SEQS=4: vLLM's batch wins (4 rows), on a
    serial engine too (its batch scheduler comes with the vLLM backend)."""
    require_vllm()
    eng = Engine(batching=BatchingOptions(enabled=False, max_batch_size=6), drain_timeout_s=300)
    try:
        _load_vllm(eng, tiny_assets, max_num_seqs=4)
        assert eng.status().batching["max_batch_size"] == 4
    finally:
        eng.shutdown()
