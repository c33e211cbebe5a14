"""Per-key quotas of /v1 (docs/security.md, "Quotas and usage"): requests per minute,
tokens per minute (prompt + completion) and requests at once, per key label, from
``KEY_LIMITS`` (``inference.quota_limits``).

A request is admitted on an estimate of its tokens (the body's bytes / 4, plus
``max_tokens`` × ``n``) before anything else runs; when it ends, the window is charged
what the request really used (``Ticket.charge``, from ``inference.shaping.count_usage``) in
place of the estimate, and its concurrent place is given back (``Ticket.release``). A key
over a limit is refused with 429 and ``Retry-After`` (the seconds until its window frees),
in each surface's shape, before any engine work.

Windows are one minute long and start with a key's first request in them (so the limit
is the same whoever sends when); they live in this process embedded and in Redis in the
distributed topology (``REDIS_URL``: one Lua script a request, so every web worker shares
them). Staff rows (``KeyLimit``, the Django admin's Key limits) override the setting field
by field; a background thread reads them every ``ROWS_REFRESH_S``. With neither set, or
keys off, a request costs one settings read and a clock check (``admission_ticket``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from django.conf import settings

from core.errors import MillmError
from inference.quota_limits import Limits, limits_for, parse_key_limits

log = structlog.get_logger(__name__)

WINDOW_MS = 60_000
# a concurrent place a web process never gave back (it died) is free again after this
CONCURRENT_LEASE_MS = 15 * 60_000
# the Retry-After of a refusal for requests at once (nothing says when one ends)
CONCURRENT_RETRY_S = 1

_KINDS = {
    "rpm": ("requests", "requests per min (RPM)"),
    "tpm": ("tokens", "tokens per min (TPM)"),
    "concurrent": ("requests", "requests at once"),
}


class RateLimited(MillmError):
    """/api's shape of a quota refusal (429 RATE_LIMIT_EXCEEDED, with Retry-After)."""

    code, status = "RATE_LIMIT_EXCEEDED", 429


@dataclass(frozen=True)
class Refusal:
    limit: str  # rpm | tpm | concurrent
    allowed: int
    used: int
    requested: int
    retry_after_s: int

    def message(self, label: str) -> str:
        _, name = _KINDS[self.limit]
        return (
            f"Rate limit reached for key {label} on {name}: Limit {self.allowed}, Used {self.used}, "
            f"Requested {self.requested}. Please try again in {self.retry_after_s}s (KEY_LIMITS)."
        )

    def details(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "allowed": self.allowed,
            "used": self.used,
            "requested": self.requested,
            "retry_after": self.retry_after_s,
        }


def _retry_s(ms: float) -> int:
    return max(1, math.ceil(ms / 1000))


# ------------------------------------------------------------------ the limiters


class LocalLimiter:
    """This process's windows (embedded mode): the same rules as ``RedisLimiter``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], list[float]] = {}  # (label, rpm|tpm) -> [ends_ms, used]
        self._held: dict[str, set[str]] = {}

    @staticmethod
    def _now_ms() -> float:
        return time.monotonic() * 1000

    def _window(self, label: str, kind: str, now: float) -> list[float] | None:
        window = self._windows.get((label, kind))
        if window is not None and window[0] <= now:
            del self._windows[(label, kind)]
            return None
        return window

    def admit_now(self, label: str, limits: Limits, estimate: int, ticket: str) -> Refusal | None:
        with self._lock:
            now = self._now_ms()
            held = self._held.setdefault(label, set())
            if limits.concurrent is not None and len(held) >= limits.concurrent:
                return Refusal("concurrent", limits.concurrent, len(held), 1, CONCURRENT_RETRY_S)
            rpm = self._window(label, "rpm", now)
            if limits.rpm is not None and rpm is not None and rpm[1] >= limits.rpm:
                return Refusal("rpm", limits.rpm, int(rpm[1]), 1, _retry_s(rpm[0] - now))
            tpm = self._window(label, "tpm", now)
            used = int(tpm[1]) if tpm is not None else 0
            if limits.tpm is not None and used + estimate > limits.tpm:
                retry = _retry_s(tpm[0] - now) if tpm is not None else _retry_s(WINDOW_MS)
                return Refusal("tpm", limits.tpm, used, estimate, retry)
            if limits.rpm is not None:
                rpm = rpm or self._windows.setdefault((label, "rpm"), [now + WINDOW_MS, 0])
                rpm[1] += 1
            if limits.tpm is not None and estimate > 0:
                tpm = tpm or self._windows.setdefault((label, "tpm"), [now + WINDOW_MS, 0])
                tpm[1] += estimate
            if limits.concurrent is not None:
                held.add(ticket)
            return None

    async def admit(self, label: str, limits: Limits, estimate: int, ticket: str) -> Refusal | None:
        return self.admit_now(label, limits, estimate, ticket)

    def release(self, label: str, limits: Limits, ticket: str, delta: int) -> None:
        with self._lock:
            self._held.get(label, set()).discard(ticket)
            if limits.tpm is None or delta == 0:
                return
            now = self._now_ms()
            tpm = self._window(label, "tpm", now)
            if tpm is not None:
                tpm[1] = max(0, tpm[1] + delta)
            elif delta > 0:
                self._windows[(label, "tpm")] = [now + WINDOW_MS, delta]

    def used(self, label: str) -> dict[str, int]:
        """The key's current windows and places (tests and the admin)."""
        with self._lock:
            now = self._now_ms()
            rpm, tpm = self._window(label, "rpm", now), self._window(label, "tpm", now)
            return {
                "rpm": int(rpm[1]) if rpm else 0,
                "tpm": int(tpm[1]) if tpm else 0,
                "concurrent": len(self._held.get(label, ())),
            }


# KEYS: rpm counter, tpm counter, concurrent set (member = ticket, score = lease end).
# ARGV: now_ms, rpm, tpm, concurrent (0 = not limited), estimate, ticket, lease_ms, window_ms.
# Returns {1} admitted, or {0, limit, allowed, used, requested, retry_ms}.
_ADMIT_LUA = """
local now = tonumber(ARGV[1])
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local est, window = tonumber(ARGV[5]), tonumber(ARGV[8])
local function left(key)
  local ttl = redis.call('PTTL', key)
  if ttl < 0 then return window end
  return ttl
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local held = redis.call('ZCARD', KEYS[3])
  if held >= conc then return {0, 'concurrent', conc, held, 1, 0} end
end
if rpm > 0 then
  local used = tonumber(redis.call('GET', KEYS[1]) or '0')
  if used >= rpm then return {0, 'rpm', rpm, used, 1, left(KEYS[1])} end
end
if tpm > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used + est > tpm then return {0, 'tpm', tpm, used, est, left(KEYS[2])} end
end
if rpm > 0 then
  if redis.call('INCR', KEYS[1]) == 1 or redis.call('PTTL', KEYS[1]) < 0 then
    redis.call('PEXPIRE', KEYS[1], window)
  end
end
if tpm > 0 and est > 0 then
  local ttl = redis.call('PTTL', KEYS[2])
  redis.call('INCRBY', KEYS[2], est)
  if ttl < 0 then redis.call('PEXPIRE', KEYS[2], window) end
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[7]), ARGV[6])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[7]))
end
return {1}
"""

# KEYS: tpm counter, concurrent set. ARGV: ticket, delta (tokens; 0 = none), window_ms.
_RELEASE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('PTTL', KEYS[1]) > 0 then
    local v = redis.call('INCRBY', KEYS[1], delta)
    if v < 0 then redis.call('INCRBY', KEYS[1], -v) end
  elseif delta > 0 then
    redis.call('SET', KEYS[1], delta, 'PX', tonumber(ARGV[3]))
  end
end
return 1
"""


class RedisLimiter:
    """The windows in Redis, shared by every web process (distributed mode): one script
    call to admit, one to release. Redis' clock decides the windows (``PEXPIRE``); an
    unreachable Redis is ``engine_unavailable`` (503), as for admission."""

    def __init__(self, *, url: str, prefix: str, timeout_s: float = 1.0) -> None:
        import redis

        from inference.admission_shared import _client_options

        self._url, self._timeout_s = url, timeout_s
        self._prefix = f"{prefix}:quota"
        self._sync = redis.Redis.from_url(url, **_client_options(timeout_s))
        self._sync_release = self._sync.register_script(_RELEASE_LUA)
        self._links: dict[asyncio.AbstractEventLoop, tuple[Any, Any, Any]] = {}
        self._lock = threading.Lock()

    def _keys(self, label: str) -> list[str]:
        base = f"{self._prefix}:{label}"
        return [f"{base}:rpm", f"{base}:tpm", f"{base}:concurrent"]

    def _link(self) -> tuple[Any, Any, Any]:
        from inference.admission_shared import per_loop

        def make() -> tuple[Any, Any, Any]:
            from redis import asyncio as aredis

            from inference.admission_shared import _client_options

            client = aredis.Redis.from_url(self._url, **_client_options(self._timeout_s))
            return client, client.register_script(_ADMIT_LUA), client.register_script(_RELEASE_LUA)

        return per_loop(self._links, self._lock, make)

    @staticmethod
    def _args(limits: Limits, estimate: int, ticket: str) -> list[Any]:
        return [
            int(time.time() * 1000),
            limits.rpm or 0,
            limits.tpm or 0,
            limits.concurrent or 0,
            estimate,
            ticket,
            CONCURRENT_LEASE_MS,
            WINDOW_MS,
        ]

    @staticmethod
    def _refusal(out: list[Any]) -> Refusal | None:
        if int(out[0]) == 1:
            return None
        limit, allowed, used, requested, retry_ms = out[1], int(out[2]), int(out[3]), int(out[4]), int(out[5])
        retry = CONCURRENT_RETRY_S if limit == "concurrent" else _retry_s(retry_ms)
        return Refusal(str(limit), allowed, used, requested, retry)

    async def admit(self, label: str, limits: Limits, estimate: int, ticket: str) -> Refusal | None:
        _, admit, _ = self._link()
        try:
            out = await admit(keys=self._keys(label), args=self._args(limits, estimate, ticket))
        except Exception as exc:  # noqa: BLE001 - redis' errors: the service is unavailable
            raise _unreachable(exc) from None
        return self._refusal(out)

    def admit_now(self, label: str, limits: Limits, estimate: int, ticket: str) -> Refusal | None:
        """``admit`` for a thread without an event loop."""
        script = self._sync.register_script(_ADMIT_LUA)
        try:
            out = script(keys=self._keys(label), args=self._args(limits, estimate, ticket))
        except Exception as exc:  # noqa: BLE001
            raise _unreachable(exc) from None
        return self._refusal(out)

    def release(self, label: str, limits: Limits, ticket: str, delta: int) -> asyncio.Task | None:
        """Give the place back and settle the tokens: at once from a thread, as a task
        (returned) on an event loop, which must not wait on Redis."""
        keys = self._keys(label)[1:]
        args = [ticket, delta if limits.tpm is not None else 0, WINDOW_MS]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        try:
            if loop is None:
                self._sync_release(keys=keys, args=args)
                return None
            _, _, release = self._link()
            task = loop.create_task(release(keys=keys, args=args))
            _PENDING.add(task)
            task.add_done_callback(_done)
            return task
        except Exception as exc:  # noqa: BLE001 - a lost release frees itself (lease, window)
            log.warning("quota_release_failed", key=label, error=str(exc))
            return None

    def used(self, label: str) -> dict[str, int]:
        rpm, tpm, conc = self._keys(label)
        now = int(time.time() * 1000)
        self._sync.zremrangebyscore(conc, "-inf", now)
        return {
            "rpm": int(self._sync.get(rpm) or 0),
            "tpm": int(self._sync.get(tpm) or 0),
            "concurrent": int(self._sync.zcard(conc)),
        }


_PENDING: set[asyncio.Task] = set()


def _done(task: asyncio.Task) -> None:
    _PENDING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("quota_release_failed", error=str(task.exception()))


def _unreachable(exc: Exception) -> MillmError:
    from core.errors import EngineUnavailable

    return EngineUnavailable(f"Redis is unreachable: {exc}", retry_after=settings.RETRY_AFTER_NOT_LOADED_S)


_LIMITER: LocalLimiter | RedisLimiter | None = None
_LIMITER_LOCK = threading.Lock()


def limiter() -> LocalLimiter | RedisLimiter:
    """This process's limiter: Redis's when the site has Redis, else its own."""
    global _LIMITER
    if _LIMITER is None:
        with _LIMITER_LOCK:
            if _LIMITER is None:
                if settings.EMBEDDED or not settings.REDIS_URL:
                    _LIMITER = LocalLimiter()
                else:
                    _LIMITER = RedisLimiter(url=settings.REDIS_URL, prefix=settings.ENGINE_STREAM_PREFIX)
    return _LIMITER


@contextlib.contextmanager
def replaced(other: LocalLimiter | RedisLimiter):
    """Use ``other`` as this process's limiter inside the block (tests)."""
    global _LIMITER
    saved, _LIMITER = _LIMITER, other
    try:
        yield other
    finally:
        _LIMITER = saved


# ------------------------------------------------------------------ tickets


@dataclass
class Ticket:
    """One admitted request's hold on its key's windows: charged its real tokens when
    they are known, released once (its concurrent place back, the estimate replaced by
    the real count, or refunded when none was counted)."""

    label: str
    limits: Limits
    estimate: int
    backend: LocalLimiter | RedisLimiter
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    actual: int | None = None
    owned: bool = False  # a Resources holds it (inference.streaming) and releases it
    done: bool = False
    sent: asyncio.Task | None = None  # the release, when it was sent from an event loop

    def charge(self, tokens: int) -> None:
        self.actual = (self.actual or 0) + max(0, int(tokens))

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        delta = (self.actual if self.actual is not None else 0) - self.estimate
        self.sent = self.backend.release(self.label, self.limits, self.id, delta)


_CURRENT: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("millm_quota_ticket", default=None)


def current_ticket() -> Ticket | None:
    """The ticket the view admitted this request on (``serve_generation`` takes it)."""
    return _CURRENT.get()


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> dict[str, dict[str, int | None]]:
    return parse_key_limits(text)


# the staff's overrides (``KeyLimit`` rows): read by one thread at most every
# ROWS_REFRESH_S, never on a request's path (which uses the last rows read)
ROWS_REFRESH_S = 5.0
_ROWS: dict[str, dict[str, int]] = {}
_ROWS_READ_AT = -math.inf
_ROWS_READING = threading.Lock()
_ROW_READER = ThreadPoolExecutor(1, thread_name_prefix="millm-key-limits")
_MERGED: tuple[Any, Any, dict[str, dict[str, int | None]]] = (None, None, {})


def read_rows() -> None:
    """Read the ``KeyLimit`` rows now (the reader thread; an admin save in this process)."""
    global _ROWS, _ROWS_READ_AT
    from django.db import connection

    from inference.models import KeyLimit

    try:
        _ROWS = {row.label: row.fields() for row in KeyLimit.objects.all() if row.fields()}
    except Exception as exc:  # noqa: BLE001 - keep the last rows; say why
        log.warning("key_limits_read_failed", error=str(exc))
    finally:
        _ROWS_READ_AT = time.monotonic()
        connection.close()


def _read_in_background() -> None:
    try:
        read_rows()
    finally:
        _ROWS_READING.release()


def _rows() -> dict[str, dict[str, int]]:
    if time.monotonic() - _ROWS_READ_AT > ROWS_REFRESH_S and _ROWS_READING.acquire(blocking=False):
        try:
            _ROW_READER.submit(_read_in_background)
        except RuntimeError:  # shutting down
            _ROWS_READING.release()
    return _ROWS


def table() -> dict[str, dict[str, int | None]]:
    """``KEY_LIMITS`` with the staff's rows over it, field by field."""
    global _MERGED
    value = getattr(settings, "KEY_LIMITS", None)
    base = (_parsed(value) if isinstance(value, str) else value) if value else {}
    rows = _rows()
    if not rows:
        return base
    if _MERGED[0] is not base or _MERGED[1] is not rows:
        merged = {label: dict(fields) for label, fields in base.items()}
        for label, fields in rows.items():
            merged.setdefault(label, {}).update(fields)
        _MERGED = (base, rows, merged)
    return _MERGED[2]


def estimate_tokens(body_bytes: int, max_tokens: int | None, n: int | None = 1) -> int:
    """What a request is admitted on: its body's bytes / 4 (a token is about four
    characters) plus the completion tokens it may ask for."""
    return max(1, body_bytes // 4) + max(0, int(max_tokens or 0)) * max(1, int(n or 1))


async def admit(who: Any, estimate: int) -> Ticket | Refusal | None:
    """Admit one request of ``who`` (a ``core.auth.Principal``): None when nothing limits
    it, a ``Ticket`` when admitted, a ``Refusal`` when over a limit."""
    rules = table()
    if not rules:
        return None
    from core.auth import keys_enabled

    if not keys_enabled():
        return None
    limits = limits_for(rules, who.label, admin=who.admin)
    if not limits.any:
        return None
    return await _admit(who.label, limits, estimate, event="quota_refused")


async def _admit(label: str, limits: Limits, estimate: int, *, event: str) -> Ticket | Refusal:
    """Take ``label``'s place in its windows (tokens counted only under a tpm limit): a
    ``Ticket`` when admitted, else the ``Refusal``, logged as ``event``."""
    backend = limiter()
    ticket = Ticket(label=label, limits=limits, estimate=estimate if limits.tpm is not None else 0, backend=backend)
    refusal = await backend.admit(label, limits, ticket.estimate, ticket.id)
    if refusal is not None:
        log.info(event, key=label, limit=refusal.limit, retry_after=refusal.retry_after_s)
        return refusal
    return ticket


def openai_refusal(who: Any, refusal: Refusal) -> Exception:
    from inference.errors import OpenAIError

    kind, _ = _KINDS[refusal.limit]
    headers = {f"x-ratelimit-limit-{kind}": str(refusal.allowed), f"x-ratelimit-remaining-{kind}": "0"}
    return OpenAIError(
        refusal.message(who.label),
        status=429,
        code="rate_limit_exceeded",
        type=kind,
        retry_after=refusal.retry_after_s,
        headers=headers,
    )


@contextlib.asynccontextmanager
async def admission_ticket(request: Any, *, max_tokens: int | None = None, n: int | None = 1) -> AsyncIterator[None]:
    """Around a /v1 route's work: refuse a key over its limits (429 in OpenAI's shape)
    before anything runs, else hold a ticket that the request's ``Resources`` take over
    (``serve_generation``) or that is released when the block ends."""
    if not table():  # the hot path with KEY_LIMITS empty: nothing more
        yield
        return
    from core.auth import principal

    who = principal(request)
    outcome = await admit(who, estimate_tokens(len(request.body), max_tokens, n))
    if isinstance(outcome, Refusal):
        raise openai_refusal(who, outcome)
    if outcome is None:
        yield
        return
    token = _CURRENT.set(outcome)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        if not outcome.owned:
            outcome.release()
        if outcome.sent is not None:
            # released before the answer leaves (a JSON answer): the key's next request,
            # sent once this one is answered, finds its place free in every process
            with contextlib.suppress(Exception):
                await asyncio.shield(outcome.sent)


async def batch_line_ticket(owner: str, body: dict[str, Any]) -> Ticket | Refusal | None:
    """A Batch API line of ``owner``'s batch (``key:<label>``), against that key's requests
    and tokens per minute — the same windows as its /v1 requests (its concurrent limit does
    not apply: BATCH_ENGINE_ROWS bounds a batch's lines at the engine). None when nothing
    limits it; a ``Refusal`` is not the line's answer: the runner puts the line back and
    pauses the batch for ``retry_after_s`` (``batches.lines.answer_line``)."""
    rules = table()
    if not rules:
        return None
    from core.auth import keys_enabled, principal_for

    who = principal_for(owner) if keys_enabled() else None
    if who is None:  # keys off, or the key is no longer configured: nothing to limit by
        return None
    own = limits_for(rules, who.label, admin=who.admin)
    limits = Limits(rpm=own.rpm, tpm=own.tpm)
    if not limits.any:
        return None
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    n = body.get("n")
    estimate = estimate_tokens(
        len(json.dumps(body)), max_tokens if isinstance(max_tokens, int) else None, n if isinstance(n, int) else 1
    )
    return await _admit(who.label, limits, estimate, event="quota_batch_line_waits")


async def api_ticket(request: Any) -> Ticket | None:
    """The same for an /api route that runs on the engine (``POST /api/probes/score``):
    429 ``RATE_LIMIT_EXCEEDED`` in the envelope; the caller releases the ticket."""
    if not table():
        return None
    from core.auth import principal

    who = principal(request)
    outcome = await admit(who, estimate_tokens(len(request.body), None))
    if isinstance(outcome, Refusal):
        raise RateLimited(outcome.message(who.label), details=outcome.details(), retry_after=outcome.retry_after_s)
    return outcome
