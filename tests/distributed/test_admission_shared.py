"""Admission shared by several web processes through Redis: one set of slots and one queue
for the engine, whichever process a request reached; a dead process's slots come back."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from inference.admission import QueueFull, SharedAdmissionController


@pytest.fixture
def make(redis_url):
    prefix = f"adm{secrets.token_hex(3)}"
    made: list[SharedAdmissionController] = []

    def factory(slots: int = 1, pending: int = 1, lease_s: float = 0.6
                ) -> SharedAdmissionController:
        ctl = SharedAdmissionController(url=redis_url, prefix=prefix, slots=slots,
                                        max_pending=pending, window=3, retry_default_s=5,
                                        retry_max_s=60, lease_s=lease_s)
        made.append(ctl)
        return ctl

    yield factory
    for ctl in made:
        ctl.close()


def test_two_processes_share_the_slots_and_the_queue(make):
    a, b = make(slots=1, pending=1), make(slots=1, pending=1)

    async def scenario() -> None:
        held = a.try_acquire()
        with pytest.raises(QueueFull):
            b.try_acquire()  # the slot is taken, even though b holds nothing itself
        waiter = asyncio.create_task(b.acquire())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert (a.stats().in_flight, b.stats().waiting) == (1, 1)
        with pytest.raises(QueueFull) as refused:  # the one queue place is taken too
            await a.acquire()
        assert refused.value.retry_after == 5
        held.release()
        permit = await asyncio.wait_for(waiter, 2)
        assert permit.waited and a.stats().in_flight == 1 and a.stats().waiting == 0
        permit.release()
        assert b.stats().in_flight == 0
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
        for ctl, name in ((b, "b1"), (c, "c1"), (b, "b2"), (a, "a1")):
            tasks.append(asyncio.create_task(wait(ctl, name)))
            await asyncio.sleep(0.02)
        first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return order

    assert asyncio.run(scenario()) == ["b1", "c1", "b2", "a1"]


def test_a_dead_process_gives_its_slots_back(make):
    dead, alive = make(slots=2, pending=0, lease_s=0.6), make(slots=2, pending=0)
    dead.try_acquire()
    dead.try_acquire()
    dead.close()  # no more lease renewals: as if the process had been killed
    with pytest.raises(QueueFull):
        alive.try_acquire()
    deadline = time.monotonic() + 3
    while True:
        try:
            alive.try_acquire()
            break
        except QueueFull:
            assert time.monotonic() < deadline, "the dead process's slots never came back"
            time.sleep(0.05)
    alive.try_acquire()  # both
    assert alive.stats().in_flight == 2


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
