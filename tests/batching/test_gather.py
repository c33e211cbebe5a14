"""A burst of requests reaching an idle batching engine starts as one batch: the serving
tier announces each generation request as it comes in (``Engine.arriving``), and the
first prefill waits for announced requests still being prepared, at most
``BatchingOptions.gather_ms`` (``CBM_GATHER_MS``). Observed through the forward passes the
model runs (their batch sizes) and the time the first one starts."""

from __future__ import annotations

import threading
import time

import pytest

from gpu_engine.api.protocol import BatchingOptions, GenerationJob, SamplingParams

from .conftest import Choreography, load

PROMPTS = ["the cat sat on the mat and", "a quick brown fox jumps over", "hello there"]


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gathering(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=2000))
    yield eng
    eng.shutdown()


def run_burst(eng, *, announce: bool, late_s: float = 0.3) -> tuple[Choreography, float]:
    """Three requests: the first submitted at once, two more ``late_s`` later (as the web
    tier would after parsing and planning them). Returns the forward passes' record and
    the seconds from the first submission to the first forward pass."""
    choreo = Choreography(eng.backend.model)
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
    return choreo, choreo.started[0] - t0


def one_request(eng, name: str, meanwhile=None) -> tuple[float, float]:  # noqa: ANN001
    """One request on ``eng``; ``meanwhile()`` runs on this thread right after it is
    submitted. Returns when it was submitted and when its first forward pass started
    (``time.monotonic``), once it has finished with all its tokens."""
    choreo = Choreography(eng.backend.model)
    with choreo.installed():
        submitted = time.monotonic()
        stream = eng.generate(GenerationJob(name, prompt=PROMPTS[0], sampling=greedy()))
        if meanwhile is not None:
            meanwhile()
        assert stream.result(60).usage.completion_tokens == 4
    return submitted, choreo.started[0]


def test_announced_requests_are_prefilled_with_the_first_one(gathering):
    choreo, _ = run_burst(gathering, announce=True)
    prefilled, decodes = choreo.prefills_then_decodes()
    # all three prefilled before any decode step, then every step decodes the three rows
    assert prefilled == 3, choreo.shapes
    assert decodes == [3, 3, 3], choreo.shapes


def test_without_announcements_the_first_request_starts_at_once(gathering):
    choreo, started = run_burst(gathering, announce=False)
    prefilled, decodes = choreo.prefills_then_decodes()
    # the first request was prefilled and decoded alone before the others were submitted
    assert prefilled == 1 and decodes[:3] == [1, 1, 1], choreo.shapes
    assert started < 0.25, started


def test_the_wait_ends_when_an_announced_request_is_withdrawn(gathering):
    """A request that ends before it submits anything (a 400, a client that left)
    releases its announcement: the batch starts then, not at the end of gather_ms."""
    withdrawn = gathering.arriving()
    submitted, first = one_request(gathering, "alone", lambda: threading.Timer(0.2, withdrawn.release).start())
    assert 0.15 < first - submitted < 1.5, first - submitted  # gather_ms is 2 s


def test_the_wait_is_bounded_by_gather_ms(tiny_assets):
    eng = load(tiny_assets, "tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=300))
    try:
        never = eng.arriving()  # announced, never submitted nor released in time
        submitted, first = one_request(eng, "bounded")
        assert 0.29 <= first - submitted < 5, first - submitted
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
        pending = eng.arriving()
        submitted, first = one_request(eng, "no-wait")
        pending.release()
        assert first - submitted < 0.25
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
    from gpu_engine.api.errors import InvalidParameter

    with pytest.raises(InvalidParameter, match="gather_ms"):
        BatchingOptions(enabled=True, gather_ms=-1)


def test_a_lone_request_does_not_wait_for_its_own_announcement(gathering):
    """The serving tier withdraws a request's announcement just after submitting it; the
    engine may see the job first, and then starts as the announcement goes (woken by it),
    not at the end of gather_ms."""
    own = gathering.arriving()
    released: list[float] = []

    def release_later() -> None:
        time.sleep(0.1)  # the worker has taken the job and is waiting for the announcement
        released.append(time.monotonic())
        own.release()

    _, first = one_request(gathering, "lone", release_later)
    assert 0 <= first - released[0] < 0.5, first - released[0]
