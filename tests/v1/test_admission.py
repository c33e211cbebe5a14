"""Backpressure: slots plus a bounded queue, immediate refusal beyond with an estimated
Retry-After that the official client honours, and a client that hangs up frees its slot
and stops its generation."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest

from inference.admission import AdmissionController, QueueFull, queue_figures
from tests.v1.helpers import assert_openai_error, open_stream, request

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ---------------------------------------------------------------- the controller itself


def test_estimate_is_median_duration_times_position_capped():
    ctl = AdmissionController(slots=1, max_pending=1, window=3, retry_default_s=5, retry_max_s=60)
    permit = ctl.try_acquire()
    with pytest.raises(QueueFull) as err:
        ctl.try_acquire()
    assert err.value.retry_after == 5  # nothing measured yet
    permit.release()
    ctl._durations.extend([2.0, 10.0, 3.0])  # median 3 s
    assert ctl.stats().estimated_wait_seconds == 3.0

    async def fill() -> None:
        holder = await ctl.acquire()
        waiter = asyncio.ensure_future(ctl.acquire())
        await asyncio.sleep(0)
        assert ctl.stats().waiting == 1
        with pytest.raises(QueueFull) as full:
            await ctl.acquire()
        assert full.value.retry_after == 6  # position 2 × median 3 s
        ctl._durations.extend([100.0, 100.0, 100.0])
        with pytest.raises(QueueFull) as capped:
            await ctl.acquire()
        assert capped.value.retry_after == 60
        holder.release()
        (await waiter).release()

    asyncio.run(fill())
    stats = ctl.stats()
    assert (stats.in_flight, stats.waiting, stats.refused_total) == (0, 0, 3)


def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot():
    ctl = AdmissionController(slots=1, max_pending=2)

    async def scenario() -> None:
        holder = await ctl.acquire()
        first = asyncio.ensure_future(ctl.acquire())
        second = asyncio.ensure_future(ctl.acquire())
        await asyncio.sleep(0)
        first.cancel()
        holder.release()  # may be handed to the cancelled one: it must pass it on
        permit = await asyncio.wait_for(second, 2)
        assert ctl.stats().in_flight == 1
        permit.release()

    asyncio.run(scenario())
    assert ctl.stats().in_flight == 0 and ctl.stats().waiting == 0


def test_slots_are_shared_across_threads_and_loops():
    ctl = AdmissionController(slots=2, max_pending=50)
    peak = [0]
    lock = threading.Lock()

    def worker() -> None:
        async def one() -> None:
            permit = await ctl.acquire()
            with lock:
                peak[0] = max(peak[0], ctl.stats().in_flight)
            await asyncio.sleep(0.01)
            permit.release()

        asyncio.run(one())

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] <= 2 and ctl.stats().in_flight == 0 and ctl.stats().admitted_total == 12


def test_slots_follow_their_source_when_it_changes():
    """The slots are read at every step (MAX_CONCURRENT_REQUESTS unset: the loaded model's
    backend): more slots admit the waiters, fewer hand out none until enough are released."""
    slots = [1]
    ctl = AdmissionController(slots=lambda: slots[0], max_pending=5)

    async def scenario() -> None:
        first = await ctl.acquire()
        waiters = [asyncio.ensure_future(ctl.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        assert (ctl.stats().in_flight, ctl.stats().waiting) == (1, 2)
        slots[0] = 3  # a model on vLLM was loaded: three slots
        first.release()  # hands its slot on, and the two new ones go to the waiters too
        held = [await asyncio.wait_for(w, 2) for w in waiters]
        assert (ctl.stats().slots, ctl.stats().in_flight, ctl.stats().waiting) == (3, 2, 0)
        slots[0] = 1  # back to a model with one slot: two are held
        late = asyncio.ensure_future(ctl.acquire())
        await asyncio.sleep(0)
        assert ctl.stats().waiting == 1
        held[0].release()  # still one held, the only slot there is: nobody new starts
        await asyncio.sleep(0)
        assert (ctl.stats().in_flight, ctl.stats().waiting) == (1, 1) and not late.done()
        held[1].release()
        (await asyncio.wait_for(late, 2)).release()

    asyncio.run(scenario())
    assert (ctl.stats().in_flight, ctl.stats().waiting) == (0, 0)


# ---------------------------------------------------------------- over the socket


def test_queue_full_is_refused_at_once_with_retry_after(llama, admission):
    ctl = admission(slots=1, pending=0, retry_default_s=7)
    held = ctl.try_acquire()
    try:
        started = time.monotonic()
        resp = request(llama.base_url, "POST", "/chat/completions", CHAT)
        assert time.monotonic() - started < 2  # refused, not queued
        assert_openai_error(resp, 503, "queue_full")
        assert resp.headers["retry-after"] == "7"
        ctl._durations.extend([1.2, 1.4, 40.0])  # median 1.4 s → ceil(1.4 × 1) = 2
        resp = request(llama.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": "x"})
        assert_openai_error(resp, 503, "queue_full")
        assert resp.headers["retry-after"] == "2"
        figures = queue_figures()
        assert figures["in_flight"] == 1 and figures["refused_total"] == 2
        assert figures["estimated_wait_seconds"] == pytest.approx(1.4)
    finally:
        held.release()


def test_the_client_retry_honours_retry_after(llama, admission, openai_client):
    ctl = admission(slots=1, pending=0, retry_default_s=1)
    held = ctl.try_acquire()
    threading.Timer(0.5, held.release).start()
    retrying = openai_client.with_options(max_retries=1)
    started = time.monotonic()
    out = retrying.chat.completions.create(**CHAT)
    elapsed = time.monotonic() - started
    assert out.choices[0].message.role == "assistant"
    assert elapsed >= 1.0  # it waited the Retry-After second, not its own backoff
    assert ctl.stats().refused_total == 1
    held2 = ctl.try_acquire()
    try:
        with pytest.raises(openai.InternalServerError) as err:  # no retries: the 503 itself
            openai_client.chat.completions.create(**CHAT)
        assert err.value.status_code == 503 and err.value.code == "queue_full"
    finally:
        held2.release()


def test_waiting_requests_are_served_in_turn(llama, admission):
    admission(slots=1, pending=3)
    results: list[int] = []

    def call() -> None:
        results.append(request(llama.base_url, "POST", "/chat/completions", {**CHAT, "max_tokens": 12}).status)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 4


def test_a_client_that_hangs_up_frees_its_slot_and_stops_generating(llama):
    from core.runtime import runtime

    body = {
        "model": "tiny-llama",
        "prompt": "the sea",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    sock, first = open_stream(llama.base_url, "/completions", body)
    assert b" 200 " in first.split(b"\r\n", 1)[0]
    assert runtime().admission.stats().in_flight == 1
    before = llama.engine.status()
    assert before.in_flight == 1
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (llama.engine.status().in_flight or runtime().admission.stats().in_flight):
        time.sleep(0.01)
    assert llama.engine.status().in_flight == 0
    assert runtime().admission.stats().in_flight == 0
    # it stopped well before max_tokens: a following request is served at once
    started = time.monotonic()
    resp = request(llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 2})
    assert resp.status == 200
    assert time.monotonic() - started < 5


def test_a_non_streaming_client_that_hangs_up_stops_its_generation(llama):
    import json
    import socket
    from urllib.parse import urlparse

    from core.runtime import runtime

    url = urlparse(llama.base_url)
    data = json.dumps({"model": "tiny-llama", "prompt": "the sea", "max_tokens": 480, "ignore_eos": True}).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and llama.engine.status().in_flight == 0:
        time.sleep(0.005)
    assert llama.engine.status().in_flight == 1
    sock.close()
    llama.wait_idle(timeout_s=5)
    assert runtime().admission.stats().in_flight == 0
