"""Admission control for generation: the slots in force (MAX_CONCURRENT_REQUESTS, or with it
unset the loaded backend's: ``core.engine_options.interactive_slots``) plus
MAX_PENDING_REQUESTS places in a queue; anything beyond is refused at once (STYLE §11).

A request either takes a slot, or waits in the queue for one, or is refused with
``queue_full`` and a ``Retry-After`` estimated from how long slots have been held lately:
the median of the last QUEUE_DURATION_WINDOW slot-holding durations × the position the
request would have had, capped at RETRY_AFTER_MAX_S (RETRY_AFTER_QUEUE_DEFAULT_S while
nothing has been measured yet).

``AdmissionController`` keeps the accounting in this process: the state sits behind a
``threading.Lock`` and waiters are woken through their own event loop, so one controller
serves any thread or loop (embedded mode). ``SharedAdmissionController``
(``inference/admission_shared.py``) keeps it in Redis for the distributed topology, where
several web processes feed one engine: the slots and the queue are the engine's,
whichever process a request arrived at; its ``acquire`` uses ``redis.asyncio`` and never
blocks the event loop. Both offer the same interface (``acquire`` / ``try_acquire`` /
``Permit.release`` / ``stats``).

This admission is the one queue of the deployment: the engine's own bounds (run_engine's
jobs in flight, the batch scheduler's queue) are derived from the same settings so that
they never queue or refuse what was admitted (``core.engine_options.engine_bounds``;
docs/api-v1.md, "Who decides the queue").
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from django.conf import settings

from core.errors import MillmError
from core.runtime import runtime


class QueueFull(MillmError):
    code, status = "QUEUE_FULL", 503


@dataclass(frozen=True)
class AdmissionStats:
    slots: int
    max_pending: int
    in_flight: int
    waiting: int
    estimated_wait_seconds: float | None
    refused_total: int
    admitted_total: int

    @property
    def pending(self) -> int:
        """Requests admitted but not finished: running plus waiting."""
        return self.in_flight + self.waiting

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots,
            "max_pending": self.max_pending,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "pending": self.pending,
            "estimated_wait_seconds": self.estimated_wait_seconds,
            "refused_total": self.refused_total,
            "admitted_total": self.admitted_total,
        }


class Permit:
    """A held slot; ``release()`` is idempotent and thread-safe (an SSE stream may be
    closed from Django's response-closing thread)."""

    __slots__ = ("_controller", "_released", "_since", "waited")

    def __init__(self, controller: AdmissionController, *, waited: bool = False) -> None:
        self._controller = controller
        self._since = time.monotonic()
        self._released = False
        self.waited = waited  # queued before getting the slot

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._controller._release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Waiter:
    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()


class AdmissionController:
    def __init__(
        self,
        *,
        slots: int | Callable[[], int],
        max_pending: int,
        window: int = 50,
        retry_default_s: int = 5,
        retry_max_s: int = 60,
    ) -> None:
        self._slots = slots if callable(slots) else _fixed(slots)
        if self.slots < 1 or max_pending < 0:
            raise ValueError("slots must be >= 1 and max_pending >= 0")
        self.max_pending = max_pending
        self.retry_default_s = retry_default_s
        self.retry_max_s = retry_max_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._durations: deque[float] = deque(maxlen=window)
        self._refused = 0
        self._admitted = 0

    @property
    def slots(self) -> int:
        """The slots in force: with MAX_CONCURRENT_REQUESTS unset they follow the loaded
        model's backend (``core.engine_options.interactive_slots``), so a load or an unload
        changes them. Fewer than are held: nobody new starts until enough are released."""
        return max(int(self._slots()), 1)

    @classmethod
    def from_settings(cls) -> AdmissionController:
        return cls(
            slots=current_slots,
            max_pending=settings.MAX_PENDING_REQUESTS,
            window=settings.QUEUE_DURATION_WINDOW,
            retry_default_s=settings.RETRY_AFTER_QUEUE_DEFAULT_S,
            retry_max_s=settings.RETRY_AFTER_MAX_S,
        )

    # ---------------------------------------------------------------- estimates

    def _estimate_locked(self, position: int) -> float | None:
        if not self._durations:
            return None
        return statistics.median(self._durations) * position

    def _retry_after_locked(self, position: int) -> int:
        estimate = self._estimate_locked(position)
        if estimate is None:
            return self.retry_default_s
        return max(1, min(self.retry_max_s, math.ceil(estimate)))

    def _refuse_locked(self) -> QueueFull:
        self._refused += 1
        position = len(self._waiters) + 1
        retry_after = self._retry_after_locked(position)
        return QueueFull(
            f"The server is at capacity ({self.slots} running, {len(self._waiters)} waiting); retry in {retry_after} s",
            details={"in_flight": self._in_flight, "waiting": len(self._waiters), "retry_after": retry_after},
            retry_after=retry_after,
        )

    # ---------------------------------------------------------------- permits

    def try_acquire(self) -> Permit:
        """A slot now, or QueueFull; never waits."""
        self._fill()
        with self._lock:
            if self._in_flight < self.slots and not self._waiters:
                self._in_flight += 1
                self._admitted += 1
                return Permit(self)
            raise self._refuse_locked()

    async def acquire(self) -> Permit:
        """A slot now, or a place in the queue until one frees, or QueueFull at once.

        A waiter whose task is cancelled (the client went away) leaves the queue; a slot
        handed to it in the same instant is passed on, never lost.
        """
        loop = asyncio.get_running_loop()
        self._fill()
        with self._lock:
            if self._in_flight < self.slots and not self._waiters:
                self._in_flight += 1
                self._admitted += 1
                return Permit(self)
            if len(self._waiters) >= self.max_pending:
                raise self._refuse_locked()
            waiter = _Waiter(loop)
            self._waiters.append(waiter)
        try:
            await waiter.future
        except BaseException:
            with self._lock:
                try:
                    self._waiters.remove(waiter)
                    handed = False
                except ValueError:
                    handed = True  # the slot was handed over as we were cancelled
            if handed:
                self._release_slot()
            raise
        return Permit(self, waited=True)

    def _release(self, permit: Permit) -> None:
        with self._lock:
            if permit._released:
                return
            permit._released = True
            self._durations.append(time.monotonic() - permit._since)
        self._release_slot()

    def _release_slot(self) -> None:
        """Hand the slot to the first live waiter, or free it (also when the slots have
        shrunk below those held: a model on another backend was loaded)."""
        while True:
            with self._lock:
                if not self._waiters or self._in_flight > self.slots:
                    self._in_flight -= 1
                    break
                waiter = self._waiters.popleft()
                self._admitted += 1
            # The slot stays counted in _in_flight: it moves to the waiter.
            if self._wake(waiter):
                break
        self._fill()

    def _fill(self) -> None:
        """Hand the slots that are free to waiters: the slots grew (a model on vLLM was
        loaded) while requests waited for the fewer there were."""
        while True:
            with self._lock:
                if not self._waiters or self._in_flight >= self.slots:
                    return
                waiter = self._waiters.popleft()
                self._in_flight += 1
                self._admitted += 1
            if not self._wake(waiter):
                with self._lock:
                    self._in_flight -= 1

    @staticmethod
    def _wake(waiter: _Waiter) -> bool:
        """Give the slot to a popped waiter. From here the slot is the waiter's: if its
        task was cancelled meanwhile, its own clean-up (not finding itself in the queue)
        passes the slot on. False only when its loop is gone and nothing would run."""

        def resolve() -> None:
            if not waiter.future.done():
                waiter.future.set_result(None)

        if _running_loop() is waiter.loop:
            resolve()
            return True
        try:
            waiter.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop closed
            return False
        return True

    # ---------------------------------------------------------------- figures

    def stats(self) -> AdmissionStats:
        with self._lock:
            waiting = len(self._waiters)
            estimate = self._estimate_locked(waiting + 1)
            return AdmissionStats(
                slots=self.slots,
                max_pending=self.max_pending,
                in_flight=self._in_flight,
                waiting=waiting,
                estimated_wait_seconds=None if estimate is None else round(estimate, 3),
                refused_total=self._refused,
                admitted_total=self._admitted,
            )


def _fixed(slots: int) -> Callable[[], int]:
    return lambda: slots


def current_slots() -> int:
    """The slots admission grants now (``core.engine_options.interactive_slots``)."""
    from core.engine_options import interactive_slots

    return interactive_slots().value


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def queue_figures() -> dict[str, Any]:
    """pending, in flight, waiting and estimated_wait_seconds for the health endpoints."""
    return runtime().admission.stats().to_dict()
