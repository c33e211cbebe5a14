"""Admission control for generation: MAX_CONCURRENT_REQUESTS slots plus
MAX_PENDING_REQUESTS places in a queue; anything beyond is refused at once (STYLE §11).

A request either takes a slot, or waits in the queue for one, or is refused with
``queue_full`` and a ``Retry-After`` estimated from how long slots have been held lately:
the median of the last QUEUE_DURATION_WINDOW slot-holding durations × the position the
request would have had, capped at RETRY_AFTER_MAX_S (RETRY_AFTER_QUEUE_DEFAULT_S while
nothing has been measured yet).

``AdmissionController`` keeps the accounting in this process: the state sits behind a
``threading.Lock`` and waiters are woken through their own event loop, so one controller
serves any thread or loop (embedded mode). ``SharedAdmissionController`` keeps it in Redis
for the distributed topology, where several web processes feed one engine: the slots and
the queue are the engine's, whichever process a request arrived at. Both offer the same
interface (``acquire`` / ``try_acquire`` / ``Permit.release`` / ``stats``).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
import uuid
from collections import deque
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
        return {"slots": self.slots, "max_pending": self.max_pending,
                "in_flight": self.in_flight, "waiting": self.waiting,
                "pending": self.pending,
                "estimated_wait_seconds": self.estimated_wait_seconds,
                "refused_total": self.refused_total, "admitted_total": self.admitted_total}


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
    def __init__(self, *, slots: int, max_pending: int, window: int = 50,
                 retry_default_s: int = 5, retry_max_s: int = 60) -> None:
        if slots < 1 or max_pending < 0:
            raise ValueError("slots must be >= 1 and max_pending >= 0")
        self.slots = slots
        self.max_pending = max_pending
        self.retry_default_s = retry_default_s
        self.retry_max_s = retry_max_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self._durations: deque[float] = deque(maxlen=window)
        self._refused = 0
        self._admitted = 0

    @classmethod
    def from_settings(cls) -> AdmissionController:
        return cls(slots=settings.MAX_CONCURRENT_REQUESTS,
                   max_pending=settings.MAX_PENDING_REQUESTS,
                   window=settings.QUEUE_DURATION_WINDOW,
                   retry_default_s=settings.RETRY_AFTER_QUEUE_DEFAULT_S,
                   retry_max_s=settings.RETRY_AFTER_MAX_S)

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
            f"The server is at capacity ({self.slots} running, {len(self._waiters)} "
            f"waiting); retry in {retry_after} s",
            details={"in_flight": self._in_flight, "waiting": len(self._waiters),
                     "retry_after": retry_after},
            retry_after=retry_after)

    # ---------------------------------------------------------------- permits

    def try_acquire(self) -> Permit:
        """A slot now, or QueueFull; never waits."""
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
        """Hand the slot to the first live waiter, or free it."""
        while True:
            with self._lock:
                if not self._waiters:
                    self._in_flight -= 1
                    return
                waiter = self._waiters.popleft()
                self._admitted += 1
            # The slot stays counted in _in_flight: it moves to the waiter.
            if self._wake(waiter):
                return

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
                slots=self.slots, max_pending=self.max_pending, in_flight=self._in_flight,
                waiting=waiting,
                estimated_wait_seconds=None if estimate is None else round(estimate, 3),
                refused_total=self._refused, admitted_total=self._admitted)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# --------------------------------------------------------------------------- shared

# One step of the shared queue, atomically: drop holders and waiters whose lease lapsed (a
# web process that died), then admit, queue, refuse or promote ``id``.
# Returns {outcome, held, waiting}: 1 admitted, 2 queued (waiting = position for a poll),
# 0 refused, -1 a poll from a waiter that lost its place.
_ADMIT_LUA = """
local now = tonumber(ARGV[1])
local id = ARGV[2]
local slots = tonumber(ARGV[3])
local max_pending = tonumber(ARGV[4])
local expiry = now + tonumber(ARGV[5])
local mode = ARGV[6]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, w in ipairs(stale) do
  redis.call('ZREM', KEYS[2], w)
  redis.call('ZREM', KEYS[3], w)
end
local held = redis.call('ZCARD', KEYS[1])
local waiting = redis.call('ZCARD', KEYS[2])
if mode == 'poll' then
  local rank = redis.call('ZRANK', KEYS[2], id)
  if not rank then return {-1, held, waiting} end
  if rank < slots - held then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZADD', KEYS[1], expiry, id)
    return {1, held + 1, waiting - 1}
  end
  redis.call('ZADD', KEYS[3], expiry, id)
  return {2, held, rank + 1}
end
if held < slots and waiting == 0 then
  redis.call('ZADD', KEYS[1], expiry, id)
  return {1, held + 1, waiting}
end
if mode == 'try' or waiting >= max_pending then return {0, held, waiting} end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), id)
redis.call('ZADD', KEYS[3], expiry, id)
return {2, held, waiting + 1}
"""


class SharedAdmissionController:
    """Admission shared by every web process through Redis (distributed mode).

    Slots and queue places are leases in sorted sets (member = permit id, score = expiry):
    each process renews its own every ``lease_s / 3`` from one background thread, so the
    slots of a web process that was killed come back within ``lease_s`` and nobody waits
    for them for ever. Waiters poll their place (a few ms apart, backing off to 100 ms)
    and take a slot in arrival order. The recent slot-holding durations behind
    ``Retry-After`` are shared too; ``refused_total`` / ``admitted_total`` count this
    process's decisions (each process exports its own metrics).
    """

    POLL_MIN_S = 0.005
    POLL_MAX_S = 0.1

    def __init__(self, *, url: str, prefix: str, slots: int, max_pending: int,
                 window: int = 50, retry_default_s: int = 5, retry_max_s: int = 60,
                 lease_s: float = 10.0, client: Any = None) -> None:
        import redis

        if slots < 1 or max_pending < 0:
            raise ValueError("slots must be >= 1 and max_pending >= 0")
        self.slots = slots
        self.max_pending = max_pending
        self.window = window
        self.retry_default_s = retry_default_s
        self.retry_max_s = retry_max_s
        self.lease_ms = max(int(lease_s * 1000), 300)
        self.redis = client or redis.Redis.from_url(url, decode_responses=True,
                                                    socket_timeout=2, socket_connect_timeout=2)
        base = f"{prefix}:admission"
        self._keys = [f"{base}:holders", f"{base}:waiters", f"{base}:waiter_expiry",
                      f"{base}:seq"]
        self._durations_key = f"{base}:durations"
        self._admit = self.redis.register_script(_ADMIT_LUA)
        self._lock = threading.Lock()
        self._ids: dict[Permit, str] = {}  # this process's permits
        self._waiting: set[str] = set()  # this process's queued ids
        self._refused = 0
        self._admitted = 0
        self._closed = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="millm-admission",
                                        daemon=True)
        self._keeper.start()

    @classmethod
    def from_settings(cls) -> SharedAdmissionController:
        return cls(url=settings.REDIS_URL, prefix=settings.ENGINE_STREAM_PREFIX,
                   slots=settings.MAX_CONCURRENT_REQUESTS,
                   max_pending=settings.MAX_PENDING_REQUESTS,
                   window=settings.QUEUE_DURATION_WINDOW,
                   retry_default_s=settings.RETRY_AFTER_QUEUE_DEFAULT_S,
                   retry_max_s=settings.RETRY_AFTER_MAX_S,
                   lease_s=max(2 * float(settings.ENGINE_DEAD_AFTER_S), 2.0))

    # ---------------------------------------------------------------- redis

    def _step(self, member: str, mode: str) -> tuple[int, int, int]:
        import redis

        try:
            outcome, held, waiting = self._admit(
                keys=self._keys, args=[int(time.time() * 1000), member, self.slots,
                                       self.max_pending, self.lease_ms, mode])
        except redis.RedisError as exc:
            from core.errors import EngineUnavailable

            raise EngineUnavailable(f"Redis is unreachable: {exc}",
                                    retry_after=settings.RETRY_AFTER_NOT_LOADED_S) from exc
        return int(outcome), int(held), int(waiting)

    def _keep_alive(self) -> None:
        while not self._closed.wait(self.lease_ms / 3000):
            with self._lock:
                held = list(self._ids.values())
                waiting = list(self._waiting)
            if not held and not waiting:
                continue
            expiry = int(time.time() * 1000) + self.lease_ms
            try:
                pipe = self.redis.pipeline(transaction=False)
                if held:
                    pipe.zadd(self._keys[0], dict.fromkeys(held, expiry), xx=True)
                if waiting:
                    pipe.zadd(self._keys[2], dict.fromkeys(waiting, expiry), xx=True)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - retried on the next beat
                import structlog

                structlog.get_logger(__name__).warning("admission_keepalive_failed",
                                                       error=repr(exc))

    def _durations(self) -> list[float]:
        try:
            return [float(x) for x in self.redis.lrange(self._durations_key, 0, -1)]
        except Exception:  # noqa: BLE001 - an estimate is optional
            return []

    def _retry_after(self, position: int) -> int:
        durations = self._durations()
        if not durations:
            return self.retry_default_s
        estimate = statistics.median(durations) * position
        return max(1, min(self.retry_max_s, math.ceil(estimate)))

    def _refuse(self, held: int, waiting: int) -> QueueFull:
        with self._lock:
            self._refused += 1
        retry_after = self._retry_after(waiting + 1)
        return QueueFull(
            f"The server is at capacity ({held} running, {waiting} waiting); retry in "
            f"{retry_after} s",
            details={"in_flight": held, "waiting": waiting, "retry_after": retry_after},
            retry_after=retry_after)

    def _grant(self, member: str, *, waited: bool) -> Permit:
        permit = Permit(self, waited=waited)  # type: ignore[arg-type]
        with self._lock:
            self._ids[permit] = member
            self._admitted += 1
        return permit

    # ---------------------------------------------------------------- permits

    def try_acquire(self) -> Permit:
        member = uuid.uuid4().hex
        outcome, held, waiting = self._step(member, "try")
        if outcome != 1:
            raise self._refuse(held, waiting)
        return self._grant(member, waited=False)

    async def acquire(self) -> Permit:
        member = uuid.uuid4().hex
        with self._lock:
            self._waiting.add(member)  # renewed from the first beat on
        try:
            outcome, held, waiting = self._step(member, "queue")
            if outcome == 0:
                raise self._refuse(held, waiting)
            delay = self.POLL_MIN_S
            while outcome != 1:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.POLL_MAX_S)
                outcome, held, waiting = self._step(member, "poll")
                if outcome == -1:  # our place lapsed (this process stalled): queue again
                    outcome, held, waiting = self._step(member, "queue")
                    if outcome == 0:
                        raise self._refuse(held, waiting)
            return self._grant(member, waited=True)
        except BaseException:
            self._forget_waiter(member)
            raise
        finally:
            with self._lock:
                self._waiting.discard(member)

    def _forget_waiter(self, member: str) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self._keys[1], member)
            pipe.zrem(self._keys[2], member)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - its lease lapses anyway
            import structlog

            structlog.get_logger(__name__).debug("admission_forget_failed", error=repr(exc))

    def _release(self, permit: Permit) -> None:
        with self._lock:
            if permit._released:
                return
            permit._released = True
            member = self._ids.pop(permit, None)
        if member is None:
            return
        held_for = time.monotonic() - permit._since
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zrem(self._keys[0], member)
            pipe.lpush(self._durations_key, f"{held_for:.4f}")
            pipe.ltrim(self._durations_key, 0, self.window - 1)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the slot's lease lapses on its own
            import structlog

            structlog.get_logger(__name__).warning("admission_release_failed",
                                                   error=repr(exc))

    # ---------------------------------------------------------------- figures

    def stats(self) -> AdmissionStats:
        now = int(time.time() * 1000)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zcount(self._keys[0], now, "+inf")
            pipe.zcount(self._keys[2], now, "+inf")
            in_flight, waiting = (int(x) for x in pipe.execute())
        except Exception:  # noqa: BLE001 - figures for health; unknown reads as 0
            in_flight = waiting = 0
        durations = self._durations()
        estimate = statistics.median(durations) * (waiting + 1) if durations else None
        with self._lock:
            refused, admitted = self._refused, self._admitted
        return AdmissionStats(
            slots=self.slots, max_pending=self.max_pending, in_flight=in_flight,
            waiting=waiting,
            estimated_wait_seconds=None if estimate is None else round(estimate, 3),
            refused_total=refused, admitted_total=admitted)

    def close(self) -> None:
        self._closed.set()


def build_admission() -> AdmissionController | SharedAdmissionController:
    """The controller this process's settings call for (the runtime builds it once): in
    this process embedded, shared through Redis in distributed mode."""
    if settings.EMBEDDED:
        return AdmissionController.from_settings()
    return SharedAdmissionController.from_settings()


def queue_figures() -> dict[str, Any]:
    """pending, in flight, waiting and estimated_wait_seconds for the health endpoints."""
    return runtime().admission.stats().to_dict()
