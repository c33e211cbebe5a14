"""Batch API work at the engine (``GenerationJob.priority == "batch"``): interactive
requests are admitted first, batch lines hold only the rows kept for them and never join
an interactive request's prefill, and on the serial path they queue behind every
interactive request. Each still answers exactly what it answers alone."""

from __future__ import annotations

import threading
import time

import pytest

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import BatchingOptions, GenerationJob

from .conftest import Choreography, load
from .test_scheduler import PROMPTS, greedy, wait_running


@pytest.fixture(scope="module")
def pair(tiny_assets):
    batched = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=2, batch_rows=2))
    serial = load(tiny_assets, "tiny-llama")
    yield batched, serial
    batched.shutdown()
    serial.shutdown()


def job(rid: str, prompt: str, n: int, priority: str = "interactive") -> GenerationJob:
    return GenerationJob(rid, prompt=prompt, sampling=greedy(n), priority=priority)


def test_priority_is_validated():
    with pytest.raises(InvalidParameter):
        GenerationJob("x", prompt="hi", priority="urgent")


def test_batch_lines_hold_only_their_rows_and_interactive_prefill_runs_alone(pair):
    batched, serial = pair
    lines = [job(f"b{i}", PROMPTS[i % 4], 30, "batch") for i in range(5)]
    interactive = [job("i0", PROMPTS[2], 6), job("i1", PROMPTS[3], 6)]
    seen_batch_rows: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen_batch_rows.append(batched.status().batching["running_batch"])
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    choreo = Choreography(batched.backend.model)
    with choreo.installed():
        line_streams = [batched.generate(j) for j in lines]
        wait_running(batched, 2)
        status = batched.status().batching
        assert (status["running_batch"], status["waiting_batch"]) == (2, 3)
        before = len(choreo.shapes)
        i_streams: list = []
        # both arrive between the same two steps (submitted from the worker's forward)
        choreo.on(before + 2, lambda: i_streams.extend(batched.generate(j) for j in interactive))
        deadline = time.monotonic() + 30
        while len(i_streams) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        i_results = [s.result(timeout_s=60) for s in i_streams]
        joined = [shape for shape in choreo.shapes[before:] if shape[1] > 1]
        line_results = [s.result(timeout_s=120) for s in line_streams]
    stop.set()
    watcher.join(5)
    # the two interactive requests got their own rows at once, beside two batch lines,
    # and their prefill was theirs alone (batch_rows were full: no batch line joined it)
    assert sum(n for n, _ in joined) == 2, joined
    assert max(seen_batch_rows) == 2
    for j, res in zip(interactive + lines, i_results + line_results):
        alone = serial.generate_sync(j)
        assert res.token_ids == alone.token_ids, j.request_id


def test_waiting_interactive_requests_go_before_waiting_batch_lines(tiny_assets):
    """Shared rows (batch_rows=0): a batch line waiting for a row lets every interactive
    request that arrives meanwhile go first."""
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=1, batch_rows=0))
    try:
        # long enough to be still running when "later" comes 50 ms after "line"
        first = eng.generate(job("long", PROMPTS[0], 150))
        wait_running(eng, 1)
        # one row: the three run one after another, so each end is at least a run of
        # 12+ forwards after the one before (far more than a thread's wake-up delay on a
        # loaded machine, which once inverted two 3-token runs' end times)
        line = eng.generate(job("line", PROMPTS[1], 30, "batch"))
        time.sleep(0.05)  # the line is waiting before the interactive request comes
        later = eng.generate(job("later", PROMPTS[2], 12))
        ended: dict[str, float] = {}
        threads = [
            threading.Thread(target=lambda s=s, k=k: (s.result(timeout_s=60), ended.__setitem__(k, time.monotonic())))
            for k, s in (("long", first), ("line", line), ("later", later))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert ended["long"] < ended["later"] < ended["line"]
    finally:
        eng.shutdown()


def test_serial_engine_runs_batch_lines_after_queued_interactive_requests(pair):
    _, serial = pair
    first = serial.generate(job("long", PROMPTS[0], 60))
    line = serial.generate(job("line", PROMPTS[1], 3, "batch"))
    later = serial.generate(job("later", PROMPTS[2], 3))
    ended: dict[str, float] = {}
    for key, stream in (("long", first), ("line", line), ("later", later)):
        threading.Thread(
            target=lambda s=stream, k=key: (s.result(timeout_s=60), ended.__setitem__(k, time.monotonic())), daemon=True
        ).start()
    deadline = time.monotonic() + 60
    while len(ended) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ended["long"] < ended["later"] < ended["line"]
