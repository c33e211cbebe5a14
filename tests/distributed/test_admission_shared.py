"""Admission shared by several web processes through Redis: one set of slots and one queue
for the engine, whichever process a request reached; a dead process's slots come back."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from inference.admission import QueueFull
from inference.admission_shared import SharedAdmissionController
from tests.distributed.conftest import REPO


@pytest.fixture
def make(redis_url):
    prefix = f"adm{secrets.token_hex(3)}"
    made: list[SharedAdmissionController] = []

    def factory(
        slots: int = 1, pending: int = 1, lease_s: float = 0.6, url: str = "", **kw
    ) -> SharedAdmissionController:
        ctl = SharedAdmissionController(
            url=url or redis_url,
            prefix=prefix,
            slots=slots,
            max_pending=pending,
            window=3,
            retry_default_s=5,
            retry_max_s=60,
            lease_s=lease_s,
            **kw,
        )
        ctl.prefix = prefix
        made.append(ctl)
        return ctl

    yield factory
    for ctl in made:
        ctl.close()


async def eventually(check, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.01)


def test_two_processes_share_the_slots_and_the_queue(make):
    a, b = make(slots=1, pending=1), make(slots=1, pending=1)

    async def scenario() -> None:
        held = a.try_acquire()
        with pytest.raises(QueueFull):
            b.try_acquire()  # the slot is taken, even though b holds nothing itself
        waiter = asyncio.create_task(b.acquire())
        await eventually(lambda: b.stats().waiting == 1)
        assert not waiter.done()
        assert a.stats().in_flight == 1
        with pytest.raises(QueueFull) as refused:  # the one queue place is taken too
            await a.acquire()
        assert refused.value.retry_after == 5
        held.release()
        permit = await asyncio.wait_for(waiter, 2)
        assert permit.waited and a.stats().in_flight == 1 and a.stats().waiting == 0
        permit.release()  # on a loop: sent from a task, without blocking the loop
        await eventually(lambda: b.stats().in_flight == 0)
        # the holding time is shared: the next refusal's Retry-After estimates from it
        assert a.stats().estimated_wait_seconds is not None

    asyncio.run(scenario())


def test_waiters_are_served_in_arrival_order_across_processes(make):
    a, b, c = make(slots=1, pending=5), make(slots=1, pending=5), make(slots=1, pending=5)

    async def scenario() -> list[str]:
        first = a.try_acquire()
        order: list[str] = []

        async def wait(ctl: SharedAdmissionController, name: str) -> None:
            permit = await ctl.acquire()
            order.append(name)
            await asyncio.sleep(0.02)
            permit.release()

        tasks = []
        for queued, (ctl, name) in enumerate(((b, "b1"), (c, "c1"), (b, "b2"), (a, "a1")), start=1):
            tasks.append(asyncio.create_task(wait(ctl, name)))
            await eventually(lambda n=queued: a.stats().waiting == n)
        first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order

    assert asyncio.run(scenario()) == ["b1", "c1", "b2", "a1"]


def test_the_shared_slots_follow_their_source_when_it_changes(make):
    """Every web process reads the slots at every step (MAX_CONCURRENT_REQUESTS unset: the
    backend the engine reports): more slots admit the waiters, fewer admit nobody until
    enough are released."""
    box = [1]
    a, b = make(slots=lambda: box[0], pending=5), make(slots=lambda: box[0], pending=5)

    async def scenario() -> None:
        first = a.try_acquire()
        waiter = asyncio.create_task(b.acquire())
        await eventually(lambda: a.stats().waiting == 1)
        box[0] = 3  # a model on vLLM was loaded: the waiter takes a new slot at its re-check
        second = await asyncio.wait_for(waiter, 3)
        assert (a.stats().slots, a.stats().in_flight, a.stats().waiting) == (3, 2, 0)
        box[0] = 1  # back to one slot, two held
        late = asyncio.create_task(a.acquire())
        await eventually(lambda: b.stats().waiting == 1)
        first.release()
        await eventually(lambda: a.stats().in_flight == 1)
        # the release woke nobody: one slot, held by ``second``
        assert not late.done() and a.stats().waiting == 1
        second.release()
        (await asyncio.wait_for(late, 3)).release()
        await eventually(lambda: a.stats().in_flight == 0)

    asyncio.run(scenario())


def test_a_dead_process_gives_its_slots_back(make):
    dead, alive = make(slots=2, pending=0, lease_s=0.6), make(slots=2, pending=0)
    dead.try_acquire()
    dead.try_acquire()
    dead._closed.set()  # no more lease renewals and no goodbye: as if it had been killed
    with pytest.raises(QueueFull):
        alive.try_acquire()
    deadline = time.monotonic() + 3
    for _ in range(2):  # both (their leases were taken, so lapse, a moment apart)
        while True:
            try:
                alive.try_acquire()
                break
            except QueueFull:
                assert time.monotonic() < deadline, "the dead process's slots never came back"
                time.sleep(0.05)
    assert alive.stats().in_flight == 2


def test_a_process_that_stops_gives_its_slots_back_at_once(make):
    """A web server stopped (SIGTERM: serve shuts the runtime down) hands its slots and
    queue places back at once, not after its leases lapse."""
    stopping, other = make(slots=1, pending=1, lease_s=30), make(slots=1, pending=1)
    stopping.try_acquire()
    with pytest.raises(QueueFull):
        other.try_acquire(), other.try_acquire()
    stopping.close()
    assert other.stats().in_flight == 0
    other.try_acquire()  # well inside the 30 s lease


def test_a_live_holder_keeps_its_slot_past_the_lease(make):
    holder, other = make(slots=1, pending=0, lease_s=0.6), make(slots=1, pending=0)
    permit = holder.try_acquire()
    time.sleep(1.5)  # well past one lease: renewed in the background
    with pytest.raises(QueueFull):
        other.try_acquire()
    permit.release()
    other.try_acquire().release()


def test_a_cancelled_waiter_leaves_the_queue(make):
    a, b = make(slots=1, pending=1), make(slots=1, pending=1)

    async def scenario() -> None:
        held = a.try_acquire()
        waiter = asyncio.create_task(b.acquire())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.stats().waiting == 0
        queued = asyncio.create_task(a.acquire())  # the place is free again
        await asyncio.sleep(0.05)
        held.release()
        (await asyncio.wait_for(queued, 2)).release()

    asyncio.run(scenario())


# ---------------------------------------------------------------- never blocking the loop


@contextmanager
def slow_redis(port: int, delay_s: float) -> Iterator[int]:
    """A TCP relay to Redis that holds every reply for ``delay_s``: a slow Redis."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", port))
            sockets.extend((client, upstream))
            for args in ((client, upstream, 0.0), (upstream, client, delay_s)):
                threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


async def largest_gap(stop: asyncio.Event, interval_s: float = 0.005) -> float:
    """The longest the loop went without running this task, until ``stop``."""
    largest, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        largest, last = max(largest, now - last), now
    return largest


def test_waiting_for_a_slot_never_stalls_the_event_loop(make, redis_url, redis_port):
    """Every reply of this Redis takes 0.3 s; a waiter polls and waits through it, and
    the loop keeps running other tasks all along (a blocking client would stall it for
    0.3 s on every call)."""
    holder = make(slots=1, pending=1)
    held = holder.try_acquire()
    db = redis_url.rsplit("/", 1)[1]
    with slow_redis(redis_port, 0.3) as port:
        waiting = make(slots=1, pending=1, url=f"redis://127.0.0.1:{port}/{db}")

        async def scenario() -> float:
            stop = asyncio.Event()
            ticker = asyncio.create_task(largest_gap(stop))
            waiter = asyncio.create_task(waiting.acquire())
            await asyncio.sleep(1.5)  # several round trips and polls through the slow link
            assert not waiter.done()
            held.release()  # from a thread-less context: the blocking path, here
            permit = await asyncio.wait_for(waiter, 5)
            assert permit.waited
            permit.release()
            await asyncio.sleep(0.7)  # the release's round trip, also off the loop
            stop.set()
            return await ticker

        gap = asyncio.run(scenario())
    assert gap < 0.15, f"the event loop stalled for {gap:.3f} s"


@pytest.mark.parametrize("server", ["closed port", "accepts but never answers"])
def test_an_unreachable_redis_is_a_quick_503_without_stalling_the_loop(server):
    from django.conf import settings

    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    if server == "closed port":
        listener.close()
    ctl = SharedAdmissionController(url=f"redis://127.0.0.1:{port}/0", prefix="unreachable", slots=1, max_pending=1)

    async def scenario() -> tuple[BaseException, float, float]:
        stop = asyncio.Event()
        ticker = asyncio.create_task(largest_gap(stop))
        started = time.monotonic()
        with pytest.raises(Exception) as err:
            await asyncio.wait_for(ctl.acquire(), 10)
        elapsed = time.monotonic() - started
        stop.set()
        return err.value, elapsed, await ticker

    try:
        error, elapsed, gap = asyncio.run(scenario())
    finally:
        ctl.close()
        listener.close()
    assert (error.code, error.status) == ("ENGINE_UNAVAILABLE", 503)
    assert error.retry_after == settings.RETRY_AFTER_NOT_LOADED_S
    assert elapsed < 2.0, f"took {elapsed:.2f} s to give up"
    assert gap < 0.15, f"the event loop stalled for {gap:.3f} s"


# ---------------------------------------------------------------- woken, not polled

HOLDER = """
import os, sys
os.environ["DJANGO_SETTINGS_MODULE"] = "millm_site.test_settings"
from inference.admission_shared import SharedAdmissionController
ctl = SharedAdmissionController(url=sys.argv[1], prefix=sys.argv[2], slots=1, max_pending=1)
permit = ctl.try_acquire()
print("held", flush=True)
sys.stdin.readline()
permit.release()
print("released", flush=True)
"""


def test_a_slot_released_by_another_process_admits_the_waiter_at_once(make, redis_url):
    """The waiter re-checks on its own only every 5 s here: being admitted well within
    that can only come from the release waking it."""
    waiting = make(slots=1, pending=1, wake_poll_s=5.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_url, waiting.prefix],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"

        async def scenario() -> float:
            waiter = asyncio.create_task(waiting.acquire())
            await asyncio.sleep(0.5)
            assert not waiter.done()
            released_at = time.monotonic()
            holder.stdin.write("go\n")
            holder.stdin.flush()
            permit = await asyncio.wait_for(waiter, 10)
            admitted_after = time.monotonic() - released_at
            permit.release()
            return admitted_after

        admitted_after = asyncio.run(scenario())
        assert holder.stdout.readline().strip() == "released"
    finally:
        holder.kill()
        holder.wait()
    assert admitted_after < 1.0, f"admitted {admitted_after:.2f} s after the release"


def test_a_release_on_an_event_loop_wakes_a_waiter_of_another_process(make):
    a, b = make(slots=1, pending=1, wake_poll_s=5.0), make(slots=1, pending=1, wake_poll_s=5.0)

    async def scenario() -> float:
        held = await a.acquire()
        waiter = asyncio.create_task(b.acquire())
        await asyncio.sleep(0.3)
        assert not waiter.done()
        released_at = time.monotonic()
        held.release()
        permit = await asyncio.wait_for(waiter, 10)
        admitted_after = time.monotonic() - released_at
        permit.release()
        return admitted_after

    assert asyncio.run(scenario()) < 1.0


def test_a_waiter_takes_a_slot_that_comes_back_by_lease_expiry(make):
    """No release wakes anyone when a holder's process dies; the bounded re-check does."""
    dead, alive = make(slots=1, pending=1, lease_s=0.6), make(slots=1, pending=1)
    dead.try_acquire()
    dead._closed.set()  # no more renewals, no goodbye: as if it had been killed

    async def scenario() -> None:
        permit = await asyncio.wait_for(alive.acquire(), 5)
        assert permit.waited
        permit.release()

    asyncio.run(scenario())


# ---------------------------------------------------------------- one owner of the queue


def test_the_engine_takes_every_job_admission_can_have_let_in(redis_url, settings):
    """Admission decides the queue. run_engine, configured from the same settings, reads
    every job that MAX_CONCURRENT_REQUESTS slots + MAX_PENDING_REQUESTS places can have let
    in (a request has one job at the engine at a time) rather than leaving admitted work
    waiting in the stream behind its own, second queue."""
    from core.engine_client_redis import RedisEngineClient
    from gpu_engine.api.protocol import GenerationJob, SamplingParams
    from orchestration.management.commands.run_engine import server_config
    from tests.distributed.fakes import FAST, FakeEngine, running_server

    settings.MAX_CONCURRENT_REQUESTS, settings.MAX_PENDING_REQUESTS = 1, 2
    settings.ENGINE_MAX_IN_FLIGHT = 0
    admitted_at_most = 1 + 2
    prefix = f"one{secrets.token_hex(3)}"
    engine = FakeEngine()
    with running_server(redis_url, engine, prefix, max_in_flight=server_config().max_in_flight):
        client = RedisEngineClient(
            url=redis_url,
            prefix=prefix,
            heartbeat_s=FAST["heartbeat_s"],
            dead_after_s=FAST["dead_after_s"],
            command_timeout_s=10,
        )
        handles = [
            client.generate(GenerationJob(request_id=f"req-{i}", prompt="hang", sampling=SamplingParams(max_tokens=5)))
            for i in range(admitted_at_most)
        ]
        try:
            deadline = time.monotonic() + 3
            while len(engine.generated) < admitted_at_most:
                assert time.monotonic() < deadline, (
                    f"the engine started {len(engine.generated)} of {admitted_at_most} "
                    "admitted jobs; the rest wait in the stream"
                )
                time.sleep(0.02)
        finally:
            for handle in handles:
                handle.cancel()


@pytest.mark.parametrize(("slots", "pending", "cbm_queue"), [(1, 3, 1), (4, 8, 2), (2, 0, 256)])
def test_the_batch_queue_never_refuses_what_admission_let_in(settings, slots, pending, cbm_queue):
    """Even with CBM_MAX_QUEUE_SIZE below the admission queue, the engine's batch scheduler
    built from the settings accepts every job admission can have let in at once (all of
    them arriving before its next step); only work beyond that meets its own bound."""
    from core.engine_options import batching_options
    from gpu_engine.api.errors import EngineBusy
    from gpu_engine.api.protocol import GenerationJob, SamplingParams
    from gpu_engine.runtime.scheduler import BatchScheduler

    settings.MAX_CONCURRENT_REQUESTS, settings.MAX_PENDING_REQUESTS = slots, pending
    settings.CBM_MAX_QUEUE_SIZE, settings.ENGINE_MAX_IN_FLIGHT = cbm_queue, 0
    settings.ENABLE_CONTINUOUS_BATCHING = True

    class Stream:
        cancelled = False

        def __init__(self, request_id: str) -> None:
            self.request_id = request_id

        def _put(self, event) -> None:
            pass

    scheduler = BatchScheduler(batching_options(), make_sequence=lambda *a: None, classify=lambda exc: exc)

    def enqueue(i: int) -> None:
        scheduler.enqueue(GenerationJob(f"r{i}", prompt="hi", sampling=SamplingParams(max_tokens=1)), Stream(f"r{i}"))

    for i in range(slots + pending):
        enqueue(i)
    # what admission can have let in, plus the Batch API lines a runner keeps at the engine
    capacity = slots + max(cbm_queue, pending + int(settings.BATCH_ENGINE_ROWS))
    for i in range(slots + pending, capacity):
        enqueue(i)
    with pytest.raises(EngineBusy):  # the safety net is still there
        enqueue(capacity)
