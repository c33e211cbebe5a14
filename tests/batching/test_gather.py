"""A burst of requests reaching an idle batching engine starts as one batch: the serving
tier announces each generation request as it comes in (``Engine.arriving``), and the
first prefill waits for announced requests still being prepared, at most
``BatchingOptions.gather_ms`` (``CBM_GATHER_MS``). Observed through the forward passes the
model runs (their batch sizes) and the time the first one starts."""

from __future__ import annotations

import threading
import time

import pytest

from gpu_engine.protocol import BatchingOptions, GenerationJob, SamplingParams

from .conftest import Choreography, load

PROMPTS = ["the cat sat on the mat and", "a quick brown fox jumps over", "hello there"]


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gathering(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=2000))
    yield eng
    eng.shutdown()


def run_burst(eng, *, announce: bool, late_s: float = 0.3) -> tuple[list[tuple[int, int]], float]:
    """Three requests: the first submitted at once, two more ``late_s`` later (as the web
    tier would after parsing and planning them). Returns the (rows, tokens) shapes of the
    forward passes and the seconds from the first submission to the first forward pass."""
    choreo = Choreography(eng.backend.model)
    first: list[float] = []
    choreo.on(1, lambda: first.append(time.monotonic()))
    arrivals = [eng.arriving() for _ in PROMPTS] if announce else []
    with choreo.installed():
        t0 = time.monotonic()
        streams = [eng.generate(GenerationJob("burst-0", prompt=PROMPTS[0], sampling=greedy()))]
        if arrivals:
            arrivals[0].release()
        time.sleep(late_s)
        for i in (1, 2):
            streams.append(eng.generate(GenerationJob(f"burst-{i}", prompt=PROMPTS[i], sampling=greedy())))
            if arrivals:
                arrivals[i].release()
        results = [s.result(60) for s in streams]
    assert all(r.usage.completion_tokens == 4 for r in results)
    return choreo.shapes, first[0] - t0


def prefills_then_decodes(shapes: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """The rows prefilled before the first decode step (prompts of different lengths are
    prefilled in groups: ``prefill_groups``), and the rows of every decode step."""
    first_decode = next(i for i, (_, tokens) in enumerate(shapes) if tokens == 1)
    return sum(rows for rows, _ in shapes[:first_decode]), [rows for rows, t in shapes if t == 1]


def test_announced_requests_are_prefilled_with_the_first_one(gathering):
    shapes, _ = run_burst(gathering, announce=True)
    prefilled, decodes = prefills_then_decodes(shapes)
    # all three prefilled before any decode step, then every step decodes the three rows
    assert prefilled == 3, shapes
    assert decodes == [3, 3, 3], shapes


def test_without_announcements_the_first_request_starts_at_once(gathering):
    shapes, started = run_burst(gathering, announce=False)
    prefilled, decodes = prefills_then_decodes(shapes)
    # the first request was prefilled and decoded alone before the others were submitted
    assert prefilled == 1 and decodes[:3] == [1, 1, 1], shapes
    assert started < 0.25, started


def test_the_wait_ends_when_an_announced_request_is_withdrawn(gathering):
    """A request that ends before it submits anything (a 400, a client that left)
    releases its announcement: the batch starts then, not at the end of gather_ms."""
    choreo = Choreography(gathering.backend.model)
    first: list[float] = []
    choreo.on(1, lambda: first.append(time.monotonic()))
    withdrawn = gathering.arriving()
    with choreo.installed():
        t0 = time.monotonic()
        stream = gathering.generate(GenerationJob("alone", prompt=PROMPTS[0], sampling=greedy()))
        threading.Timer(0.2, withdrawn.release).start()
        stream.result(60)
    assert 0.15 < first[0] - t0 < 1.5, first[0] - t0  # gather_ms is 2 s


def test_the_wait_is_bounded_by_gather_ms(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=300))
    try:
        choreo = Choreography(eng.backend.model)
        first: list[float] = []
        choreo.on(1, lambda: first.append(time.monotonic()))
        never = eng.arriving()  # announced, never submitted nor released in time
        with choreo.installed():
            t0 = time.monotonic()
            result = eng.generate(GenerationJob("bounded", prompt=PROMPTS[0], sampling=greedy())).result(60)
        assert result.usage.completion_tokens == 4
        assert 0.29 <= first[0] - t0 < 5, first[0] - t0
        # once the batch runs, the next idle start waits again only for a new announcement
        never.release()
        status = eng.batching_status()
        assert status["arriving"] == 0 and status["gather_ms"] == 300
        assert status["gathers"] == 1 and status["gather_wait_ms"] >= 290
    finally:
        eng.shutdown()


def test_gather_ms_zero_never_waits(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=0))
    try:
        choreo = Choreography(eng.backend.model)
        first: list[float] = []
        choreo.on(1, lambda: first.append(time.monotonic()))
        pending = eng.arriving()
        with choreo.installed():
            t0 = time.monotonic()
            eng.generate(GenerationJob("no-wait", prompt=PROMPTS[0], sampling=greedy())).result(60)
        pending.release()
        assert first[0] - t0 < 0.25
        assert eng.batching_status()["gathers"] == 0
    finally:
        eng.shutdown()


def test_a_release_is_counted_once(gathering):
    arrival = gathering.arriving()
    assert gathering.batching_status()["arriving"] == 1
    arrival.release()
    arrival.release()
    with gathering.arriving():
        assert gathering.batching_status()["arriving"] == 1
    assert gathering.batching_status()["arriving"] == 0


def test_gather_ms_is_validated():
    from gpu_engine.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="gather_ms"):
        BatchingOptions(enabled=True, gather_ms=-1)


def test_a_lone_request_does_not_wait_for_its_own_announcement(gathering):
    """The serving tier withdraws a request's announcement just after submitting it; the
    engine may see the job first, and then starts as the announcement goes (woken by it),
    not at the end of gather_ms."""
    choreo = Choreography(gathering.backend.model)
    first: list[float] = []
    choreo.on(1, lambda: first.append(time.monotonic()))
    with choreo.installed():
        own = gathering.arriving()
        stream = gathering.generate(GenerationJob("lone", prompt=PROMPTS[0], sampling=greedy()))
        time.sleep(0.1)  # the worker has taken the job and is waiting for the announcement
        released = time.monotonic()
        own.release()
        stream.result(60)
    assert 0 <= first[0] - released < 0.5, first[0] - released
