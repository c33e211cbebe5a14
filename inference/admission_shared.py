"""Admission shared by every web process through Redis (the distributed topology):
``SharedAdmissionController``, its Lua scripts and its connections.

It offers the same interface as the in-process ``inference.admission.AdmissionController``
(``acquire`` / ``try_acquire`` / ``Permit.release`` / ``stats``) and hands out the same
``Permit``; ``inference.admission.build_admission`` picks one of the two from the settings.
"""

from __future__ import annotations

import asyncio
import functools
import math
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from django.conf import settings

from core.errors import EngineUnavailable, MillmError
from core.metrics import record_admission
from inference.admission import AdmissionStats, Permit, QueueFull, _fixed, _running_loop, current_slots

# Both scripts first drop holders and waiters whose lease lapsed (a web process that died).
# Keys: holders, waiters, waiter_expiry, seq, durations. ARGV[1] = now (ms).
_PRUNE_LUA = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, w in ipairs(stale) do
  redis.call('ZREM', KEYS[2], w)
  redis.call('ZREM', KEYS[3], w)
end
"""

# One step of the shared queue, atomically: admit, queue, refuse or promote ``id``.
# Returns {outcome, held, waiting, durations...}: 1 admitted, 2 queued (waiting = position
# for a poll), 0 refused (followed by the recent slot-holding durations, for Retry-After),
# -1 a poll from a waiter that lost its place.
_ADMIT_LUA = (
    _PRUNE_LUA
    + """
local id = ARGV[2]
local slots = tonumber(ARGV[3])
local max_pending = tonumber(ARGV[4])
local expiry = now + tonumber(ARGV[5])
local mode = ARGV[6]
local held = redis.call('ZCARD', KEYS[1])
local waiting = redis.call('ZCARD', KEYS[2])
if mode == 'poll' then
  local rank = redis.call('ZRANK', KEYS[2], id)
  if not rank then return {-1, held, waiting} end
  if rank < slots - held then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('DEL', ARGV[7] .. id)
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
if mode == 'try' or waiting >= max_pending then
  local out = {0, held, waiting}
  for _, d in ipairs(redis.call('LRANGE', KEYS[5], 0, -1)) do out[#out + 1] = d end
  return out
end
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), id)
redis.call('ZADD', KEYS[3], expiry, id)
return {2, held, waiting + 1}
"""
)

# Give up ``id``'s slot or queue place (a release, a waiter that left) and wake the
# waiters the freed room now admits: a token on each one's own list, which it is blocked
# on (BLPOP), so a release reaches the next waiter at once instead of at its next poll.
# ARGV: now, id, slots, wake prefix, wake ttl (ms), held-for seconds ('' = none), window.
_RELEASE_LUA = (
    _PRUNE_LUA
    + """
local id = ARGV[2]
redis.call('ZREM', KEYS[1], id)
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', KEYS[3], id)
redis.call('DEL', ARGV[4] .. id)
if ARGV[6] ~= '' then
  redis.call('LPUSH', KEYS[5], ARGV[6])
  redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[7]) - 1)
end
local free = tonumber(ARGV[3]) - redis.call('ZCARD', KEYS[1])
if free > 0 then
  for _, w in ipairs(redis.call('ZRANGE', KEYS[2], 0, free - 1)) do
    local key = ARGV[4] .. w
    redis.call('RPUSH', key, '1')
    redis.call('LTRIM', key, -1, -1)
    redis.call('PEXPIRE', key, ARGV[5])
  end
end
return free
"""
)


def _unreachable(exc: Exception) -> MillmError:
    return EngineUnavailable(f"Redis is unreachable: {exc}", retry_after=settings.RETRY_AFTER_NOT_LOADED_S)


class _AsyncLink:
    """This process's asyncio connections to Redis for one event loop (redis.asyncio
    connections belong to the loop that opened them): one pool for the scripts, and one
    for the blocking waits, whose read timeout must outlast the wait."""

    def __init__(self, url: str, *, timeout_s: float, wait_s: float) -> None:
        from redis import asyncio as aredis  # imported (slowly) once, by the controller

        self.commands = aredis.Redis.from_url(url, **_client_options(timeout_s))
        self.waits = aredis.Redis.from_url(url, **_client_options(timeout_s + wait_s))
        self.admit = self.commands.register_script(_ADMIT_LUA)
        self.release = self.commands.register_script(_RELEASE_LUA)


def per_loop(links: dict[asyncio.AbstractEventLoop, Any], lock: threading.Lock, make: Callable[[], Any]) -> Any:
    """The running loop's entry of ``links`` (redis.asyncio connections belong to the loop
    that opened them), made by ``make`` the first time; entries of loops that have ended
    are dropped, since their connections cannot be used (or closed) again."""
    loop = asyncio.get_running_loop()
    with lock:
        link = links.get(loop)
        if link is None:
            for ended in [lp for lp in links if lp.is_closed()]:
                del links[ended]
            link = links[loop] = make()
    return link


def _client_options(timeout_s: float) -> dict[str, Any]:
    """Fail fast: short timeouts, and one immediate reconnect (a pooled connection that a
    restarted Redis closed) instead of redis-py's default ten retries with backoff, which
    turn an unreachable Redis into seconds of waiting. A timeout is not retried: a Redis
    that does not answer within ``timeout_s`` counts as down."""
    from redis import ConnectionError as RedisConnectionError
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {
        "decode_responses": True,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    }


class SharedAdmissionController:
    """Admission shared by every web process through Redis (distributed mode).

    Slots and queue places are leases in sorted sets (member = permit id, score = expiry):
    each process renews its own every ``lease_s / 3`` from one background thread, so the
    slots of a web process that was killed come back within ``lease_s`` and nobody waits
    for them for ever. Waiters take a slot in arrival order.

    Nothing here blocks an event loop: ``acquire`` talks to Redis through ``redis.asyncio``
    (one set of connections per loop). A waiter blocks (BLPOP, on its own connection) on
    its own wake-up list, which a release fills for the waiters it makes room for; it
    re-checks its place at least every ``wake_poll_s`` as well, for slots that come back
    by lease expiry. ``Permit.release`` on a loop schedules the release on that loop and
    returns at once. The synchronous ``try_acquire`` / ``stats`` (and a release from a
    thread without a loop) use a blocking client and are for threads only. Every Redis
    call gives up after ``timeout_s``: an unreachable Redis is ``engine_unavailable``
    (503, Retry-After RETRY_AFTER_NOT_LOADED_S) at once, not a hang.

    The recent slot-holding durations behind ``Retry-After`` are shared too;
    ``refused_total`` / ``admitted_total`` count this process's decisions (each process
    exports its own metrics).
    """

    def __init__(
        self,
        *,
        url: str,
        prefix: str,
        slots: int | Callable[[], int],
        max_pending: int,
        window: int = 50,
        retry_default_s: int = 5,
        retry_max_s: int = 60,
        lease_s: float = 10.0,
        timeout_s: float = 1.0,
        wake_poll_s: float = 0.5,
    ) -> None:
        import redis
        import redis.asyncio  # ~0.1 s to import: here, not in a request on the loop

        self._slots = slots if callable(slots) else _fixed(slots)
        if self.slots < 1 or max_pending < 0:
            raise ValueError("slots must be >= 1 and max_pending >= 0")
        if timeout_s <= 0 or wake_poll_s <= 0:
            raise ValueError("timeout_s and wake_poll_s must be > 0")
        self.max_pending = max_pending
        self.window = window
        self.retry_default_s = retry_default_s
        self.retry_max_s = retry_max_s
        self.lease_ms = max(int(lease_s * 1000), 300)
        self.timeout_s = timeout_s
        self.wake_poll_s = wake_poll_s
        self._url = url
        self.redis = redis.Redis.from_url(url, **_client_options(timeout_s))
        base = f"{prefix}:admission"
        self._keys = [f"{base}:holders", f"{base}:waiters", f"{base}:waiter_expiry", f"{base}:seq", f"{base}:durations"]
        self._wake_prefix = f"{base}:wake:"
        self._admit = self.redis.register_script(_ADMIT_LUA)
        self._release_script = self.redis.register_script(_RELEASE_LUA)
        self._lock = threading.Lock()
        self._links: dict[asyncio.AbstractEventLoop, _AsyncLink] = {}
        self._releases: set[asyncio.Task] = set()  # scheduled releases, kept alive
        self._ids: dict[Permit, str] = {}  # this process's permits
        self._waiting: set[str] = set()  # this process's queued ids
        self._refused = 0
        self._admitted = 0
        self._closed = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="millm-admission", daemon=True)
        self._keeper.start()

    @property
    def slots(self) -> int:
        """The slots in force, read at every admission step: with MAX_CONCURRENT_REQUESTS
        unset they follow the backend of the model the engine last reported (its status,
        which each /v1 request reads before it asks for a slot); a waiter re-checks its
        place with the value of the moment."""
        return max(int(self._slots()), 1)

    @classmethod
    def from_settings(cls) -> SharedAdmissionController:
        return cls(
            url=settings.REDIS_URL,
            prefix=settings.ENGINE_STREAM_PREFIX,
            slots=current_slots,
            max_pending=settings.MAX_PENDING_REQUESTS,
            window=settings.QUEUE_DURATION_WINDOW,
            retry_default_s=settings.RETRY_AFTER_QUEUE_DEFAULT_S,
            retry_max_s=settings.RETRY_AFTER_MAX_S,
            lease_s=max(2 * float(settings.ENGINE_DEAD_AFTER_S), 2.0),
        )

    # ---------------------------------------------------------------- redis

    def _link(self) -> _AsyncLink:
        return per_loop(
            self._links,
            self._lock,
            lambda: _AsyncLink(self._url, timeout_s=self.timeout_s, wait_s=self.wake_poll_s),
        )

    def _admit_args(self, member: str, mode: str) -> list[Any]:
        return [int(time.time() * 1000), member, self.slots, self.max_pending, self.lease_ms, mode, self._wake_prefix]

    def _release_args(self, member: str, held_for: float | None) -> list[Any]:
        return [
            int(time.time() * 1000),
            member,
            self.slots,
            self._wake_prefix,
            self.lease_ms,
            "" if held_for is None else f"{held_for:.4f}",
            self.window,
        ]

    @staticmethod
    def _outcome(reply: list[Any]) -> tuple[int, int, int, list[float]]:
        return int(reply[0]), int(reply[1]), int(reply[2]), [float(d) for d in reply[3:]]

    def _step(self, member: str, mode: str) -> tuple[int, int, int, list[float]]:
        """One step from a thread (blocking client)."""
        import redis

        try:
            return self._outcome(self._admit(keys=self._keys, args=self._admit_args(member, mode)))
        except redis.RedisError as exc:
            raise _unreachable(exc) from exc

    async def _astep(self, link: _AsyncLink, member: str, mode: str) -> tuple[int, int, int, list[float]]:
        import redis

        try:
            return self._outcome(await link.admit(keys=self._keys, args=self._admit_args(member, mode)))
        except redis.RedisError as exc:
            raise _unreachable(exc) from exc

    async def _await_turn(self, link: _AsyncLink, member: str) -> None:
        """Until a release wakes ``member`` or ``wake_poll_s`` passes."""
        import redis

        try:
            await link.waits.blpop([self._wake_prefix + member], timeout=self.wake_poll_s)
        except redis.RedisError as exc:
            raise _unreachable(exc) from exc

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

                structlog.get_logger(__name__).warning("admission_keepalive_failed", error=repr(exc))

    def _durations(self) -> list[float]:
        try:
            return [float(x) for x in self.redis.lrange(self._keys[4], 0, -1)]
        except Exception:  # noqa: BLE001 - an estimate is optional
            return []

    def _refuse(self, held: int, waiting: int, durations: list[float]) -> QueueFull:
        with self._lock:
            self._refused += 1
        record_admission("refused")
        if durations:
            estimate = statistics.median(durations) * (waiting + 1)
            retry_after = max(1, min(self.retry_max_s, math.ceil(estimate)))
        else:
            retry_after = self.retry_default_s
        return QueueFull(
            f"The server is at capacity ({held} running, {waiting} waiting); retry in {retry_after} s",
            details={"in_flight": held, "waiting": waiting, "retry_after": retry_after},
            retry_after=retry_after,
        )

    def _grant(self, member: str, *, waited: bool) -> Permit:
        permit = Permit(self, waited=waited)  # type: ignore[arg-type]
        with self._lock:
            self._ids[permit] = member
            self._admitted += 1
        record_admission("admitted")
        return permit

    # ---------------------------------------------------------------- permits

    def try_acquire(self) -> Permit:
        """A slot now, or QueueFull; never waits. Blocking: for threads, not a loop."""
        member = uuid.uuid4().hex
        outcome, held, waiting, durations = self._step(member, "try")
        if outcome != 1:
            raise self._refuse(held, waiting, durations)
        return self._grant(member, waited=False)

    async def acquire(self) -> Permit:
        link = self._link()
        member = uuid.uuid4().hex
        queued = False
        with self._lock:
            self._waiting.add(member)  # renewed from the first beat on
        try:
            outcome, held, waiting, durations = await self._astep(link, member, "queue")
            while outcome != 1:
                if outcome == 0:
                    raise self._refuse(held, waiting, durations)
                queued = True
                await self._await_turn(link, member)
                outcome, held, waiting, durations = await self._astep(link, member, "poll")
                if outcome == -1:  # our place lapsed (this process stalled): queue again
                    outcome, held, waiting, durations = await self._astep(link, member, "queue")
            return self._grant(member, waited=queued)
        except MillmError:
            raise  # refused (nothing stored) or Redis unreachable (the lease lapses)
        except BaseException:
            # cancelled (the client left): leave the queue, and pass on a slot that was
            # granted in the same instant
            await self._arelease(member, None, link=link)
            raise
        finally:
            with self._lock:
                self._waiting.discard(member)

    def _release(self, permit: Permit) -> None:
        with self._lock:
            if permit._released:
                return
            permit._released = True
            member = self._ids.pop(permit, None)
        if member is None:
            return
        held_for = time.monotonic() - permit._since
        loop = _running_loop()
        if loop is None:  # a thread (Django closing a streamed response): it may block
            self._release_blocking(member, held_for)
            return
        task = loop.create_task(self._arelease(member, held_for))
        self._releases.add(task)
        task.add_done_callback(functools.partial(self._released, member, held_for))

    def _released(self, member: str, held_for: float, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if task.cancelled():
            # the loop ended before the release went out: finish it off the loop rather
            # than leave the slot held until its lease lapses
            threading.Thread(
                target=self._release_blocking, args=(member, held_for), name="millm-admission-release", daemon=True
            ).start()

    async def _arelease(self, member: str, held_for: float | None, *, link: _AsyncLink | None = None) -> None:
        try:
            await (link or self._link()).release(keys=self._keys, args=self._release_args(member, held_for))
        except Exception as exc:  # noqa: BLE001 - the lease lapses on its own
            import structlog

            structlog.get_logger(__name__).warning("admission_release_failed", error=repr(exc))

    def _release_blocking(self, member: str, held_for: float | None) -> None:
        try:
            self._release_script(keys=self._keys, args=self._release_args(member, held_for))
        except Exception as exc:  # noqa: BLE001 - the lease lapses on its own
            import structlog

            structlog.get_logger(__name__).warning("admission_release_failed", error=repr(exc))

    # ---------------------------------------------------------------- figures

    def stats(self) -> AdmissionStats:
        """Blocking (at most ``timeout_s``): the health views call it from a thread."""
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
            slots=self.slots,
            max_pending=self.max_pending,
            in_flight=in_flight,
            waiting=waiting,
            estimated_wait_seconds=None if estimate is None else round(estimate, 3),
            refused_total=refused,
            admitted_total=admitted,
        )

    def close(self) -> None:
        """The process is stopping (serve's shutdown, SIGTERM): its slots and queue places
        go back now, not when their leases lapse (the other web workers' queue was that
        much shorter meanwhile)."""
        self._closed.set()
        with self._lock:
            members = [*self._ids.values(), *self._waiting]
        for member in members:
            self._release_blocking(member, None)
