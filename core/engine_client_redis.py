"""The engine client of the distributed topology: Redis Streams to a ``run_engine`` process.

Same interface as ``EmbeddedEngineClient`` (``core.engine_client.EngineClient``): every
method goes through ``invoke``, which sends a command of ``gpu_engine.api.commands.COMMANDS``
by name with its argument struct as JSON and decodes the command's declared result type.
No torch: this module, and what it imports, is all a web process needs to reach the engine.
How a command travels is its lane:

- ``state`` (``status()``, and ``attachments()`` from it): read from the engine's
  heartbeat (one GET). No heartbeat means no engine: ``model_not_loaded`` (503 with
  Retry-After on /v1) until one is back.
- ``control`` (load, unload, attach, detach, checks, cancel_all): the command stream;
  the caller waits, bounded, for the reply on the command's own stream.
- ``work`` / ``stream`` (embeddings and scores / generations): the request stream;
  events come back on the request's own stream. While waiting, the client keeps the
  request's ``live`` key alive (cancelling = deleting it) and checks the heartbeat
  whenever nothing arrives for a heartbeat period: a dead engine ends the wait with
  ``engine_shutdown`` within ENGINE_DEAD_AFTER_S.

Delivery semantics are the server's (``gpu_engine.server.server``, ``gpu_engine.server.delivery``); docs/deploy.md.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis
import structlog

from core.engine_client import EngineClient, GenerationHandle
from gpu_engine.api.commands import Command, Lane
from gpu_engine.api.errors import (
    EngineBusy,
    EngineError,
    EngineShutdown,
    ModelNotLoaded,
)
from gpu_engine.api.protocol import (
    ErrorEvent,
    GenerationEvent,
    ResultEvent,
    StreamEvent,
    from_builtins,
    from_json,
)
from gpu_engine.api.transport import Envelope, Keys, decode_event, is_final

log = structlog.get_logger(__name__)

# Longest single XREAD BLOCK: between blocks the client refreshes its live key and, when
# nothing came, looks at the heartbeat.
MAX_BLOCK_S = 1.0


class RedisEngineClient(EngineClient):
    def __init__(
        self,
        *,
        url: str,
        prefix: str = "millm",
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        command_timeout_s: float = 900.0,
        drain_timeout_s: float = 30.0,
        result_ttl_s: int = 600,
        client: redis.Redis | None = None,
    ) -> None:
        self.keys = Keys(prefix)
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.command_timeout_s = command_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.result_ttl_s = result_ttl_s
        # a live key outlives a few missed refreshes, not a dead web process for long
        self.live_ttl_ms = max(int(dead_after_s * 2000), 1000)
        # socket timeout above the longest block: a vanished Redis ends a wait too
        self.redis = client or redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=MAX_BLOCK_S + 10,
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        self._last: dict[str, Any] | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, *, prefix: str | None = None) -> RedisEngineClient:
        """``prefix``: another engine's (``core.engines.engine_prefix``); the default
        engine's, ENGINE_STREAM_PREFIX, unless given."""
        from django.conf import settings

        return cls(
            url=settings.REDIS_URL,
            prefix=settings.ENGINE_STREAM_PREFIX if prefix is None else prefix,
            heartbeat_s=settings.ENGINE_HEARTBEAT_S,
            dead_after_s=settings.ENGINE_DEAD_AFTER_S,
            command_timeout_s=settings.ENGINE_COMMAND_TIMEOUT_S,
            drain_timeout_s=settings.GRACEFUL_UNLOAD_TIMEOUT,
            result_ttl_s=settings.ENGINE_RESULT_TTL_S,
        )

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(self) -> dict[str, Any] | None:
        """The live engine's heartbeat, or None when no engine is alive."""
        try:
            raw = self.redis.get(self.keys.heartbeat)
        except redis.RedisError as exc:
            raise EngineShutdown(f"Redis is unreachable: {exc}") from exc
        if raw is None:
            return None
        data = json.loads(raw)
        with self._lock:
            self._last = data
        return data

    def _serving(self) -> dict[str, Any]:
        hb = self.heartbeat()
        if hb is None:
            raise ModelNotLoaded(
                "No engine process is running (no heartbeat within ENGINE_DEAD_AFTER_S="
                f"{self.dead_after_s:g}s); requests can be served again once run_engine is "
                "back",
                details={"engine": "unavailable"},
            )
        if hb.get("phase") != "serving":
            raise ModelNotLoaded(
                f"The engine is {hb.get('phase')} (restoring the recorded model and SAEs, or stopping); retry shortly",
                details={"engine": hb.get("phase")},
            )
        return hb

    @property
    def backend_name(self) -> str:  # type: ignore[override]
        with self._lock:
            last = self._last
        return str(((last or {}).get("status") or {}).get("backend") or "none")

    def resolve_device_and_dtype(self, device: str, dtype: str) -> tuple[str, str]:
        """``auto`` means what it means on the engine's host (its heartbeat says)."""
        defaults = self._serving().get("defaults") or {}
        if device == "auto":
            device = str(defaults.get("device") or "cpu")
        if dtype == "auto":
            dtype = str(defaults.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32"))
        return device, dtype

    def free_memory(self, device: str) -> int | None:
        memory = (self._serving().get("memory") or {}).get(device)
        return int(memory["free"]) if memory and memory.get("free") is not None else None

    # ------------------------------------------------------------------ commands

    def invoke(self, command: Command, args: Any) -> Any:
        if command.lane is Lane.STATE:
            # the heartbeat holds the latest result under the command's name
            return from_builtins(self._serving()[command.name], command.result)
        if command.lane is Lane.STREAM:
            return _RedisHandle(self, command, args)
        given = getattr(args, "timeout_s", None)
        if command.lane is Lane.WORK:
            self._serving()
            # the engine gives up waiting for its worker when the caller stops waiting
            wait_s = self.command_timeout_s if given is None else given
            args = command.with_timeout(args, wait_s)
            request_id = command.request_id(args)
            stream = self.keys.requests
        else:
            if self.heartbeat() is None:
                raise EngineShutdown(
                    "No engine process is running; start `manage.py run_engine`", details={"engine": "unavailable"}
                )
            # the engine's drain bound, then the command's own time
            drain = self.drain_timeout_s if given is None else given
            args = command.with_timeout(args, drain)
            wait_s = drain + self.command_timeout_s
            request_id = f"cmd-{uuid.uuid4().hex}"
            stream = self.keys.commands
        wait = _Wait(self, request_id)
        try:
            wait.submit(stream, Envelope.new(command, request_id, args, wait_s=wait_s).encode())
            for item in wait.items(overall_s=wait_s, idle_s=None):
                if isinstance(item, ErrorEvent):
                    raise item.to_exception()
                if isinstance(item, ResultEvent):
                    return from_json(item.result, command.result)
        finally:
            wait.close()
        raise EngineBusy(f"the engine did not answer {command.name} within {wait_s:g}s", details={"timeout_s": wait_s})

    def shutdown(self) -> None:
        self.redis.close()


class _Wait:
    """One request's (or command's) round trip: submit the entry with its live key, then
    read its event stream until the final entry, the engine's death or a timeout."""

    def __init__(self, client: RedisEngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        keys = client.keys
        self.events_key = keys.events(request_id)
        self.live_key = keys.live(request_id)
        self.started_key = keys.started(request_id)
        self.done = False
        self.closed = False

    def submit(self, stream: str, fields: dict[str, str]) -> None:
        try:
            pipe = self.client.redis.pipeline(transaction=True)
            pipe.set(self.live_key, "1", px=self.client.live_ttl_ms)
            pipe.xadd(stream, fields)
            pipe.execute()
        except redis.RedisError as exc:
            raise EngineShutdown(f"Redis is unreachable: {exc}") from exc

    def _engine_gone(self) -> EngineError | None:
        """Why waiting is pointless now, or None: no heartbeat, or the engine that
        started this request is not the one alive (it died; the job is not re-run)."""
        pipe = self.client.redis.pipeline(transaction=False)
        pipe.get(self.client.keys.heartbeat)
        pipe.get(self.started_key)
        raw, started_by = pipe.execute()
        if raw is None:
            return EngineShutdown(
                "The engine process stopped (no heartbeat for "
                f"{self.client.dead_after_s:g}s) before this request finished; it is not "
                "retried",
                details={"engine": "unavailable"},
            )
        engine_id = json.loads(raw).get("engine_id")
        if started_by is not None and started_by != engine_id:
            return EngineShutdown(
                "The engine process running this request stopped before it finished; it is not retried",
                details={"engine": "restarted", "started_by": started_by},
            )
        return None

    def items(self, *, overall_s: float | None, idle_s: float | None) -> Iterator[StreamEvent]:
        """Entries of the event stream in order. ``idle_s`` bounds the wait for each
        entry (EngineBusy after, like the embedded stream); ``overall_s`` the whole wait."""
        client = self.client
        r = client.redis
        last_id = "0-0"
        start = time.monotonic()
        last_item = start
        refresh_every = client.live_ttl_ms / 3000
        next_refresh = start + refresh_every
        check_every = max(client.heartbeat_s, 0.1)
        next_check = start + check_every
        while True:
            now = time.monotonic()
            limits = [next_check - now, MAX_BLOCK_S]
            if overall_s is not None:
                limits.append(start + overall_s - now)
            if idle_s is not None:
                limits.append(last_item + idle_s - now)
            block_ms = max(int(min(limits) * 1000), 1)
            try:
                response = r.xread({self.events_key: last_id}, count=512, block=block_ms)
            except redis.RedisError as exc:
                raise EngineShutdown(f"Redis is unreachable: {exc}") from exc
            got = False
            for _, entries in response or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    got = True
                    item = decode_event(fields)
                    final = is_final(item)
                    if final:
                        self.done = True
                    yield item
                    if final:
                        return
            now = time.monotonic()
            if got:
                last_item = now
            try:
                if now >= next_refresh:
                    r.pexpire(self.live_key, client.live_ttl_ms)
                    next_refresh = now + refresh_every
                if now >= next_check:
                    next_check = now + check_every
                    if now - last_item >= check_every:
                        gone = self._engine_gone()
                        if gone is not None:
                            yield ErrorEvent(self.request_id, gone.code, gone.message, gone.details)
                            self.done = True
                            return
            except redis.RedisError as exc:
                raise EngineShutdown(f"Redis is unreachable: {exc}") from exc
            if overall_s is not None and now - start >= overall_s:
                return
            if idle_s is not None and now - last_item >= idle_s:
                raise EngineBusy(f"no event for request {self.request_id!r} within {idle_s}s")

    def cancel(self) -> None:
        """Withdraw the request: the engine drops it unrun, or stops it within a step."""
        try:
            self.client.redis.delete(self.live_key)
        except redis.RedisError as exc:
            log.warning("engine_cancel_failed", request_id=self.request_id, error=repr(exc))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            keys = [self.live_key] + ([self.events_key] if self.done else [])
            self.client.redis.delete(*keys)
        except redis.RedisError as exc:
            log.warning("engine_request_cleanup_failed", request_id=self.request_id, error=repr(exc))


class _RedisHandle(GenerationHandle):
    def __init__(self, client: RedisEngineClient, command: Command, args: Any) -> None:
        self.request_id = command.request_id(args)
        self._client = client
        self._wait = _Wait(client, self.request_id)
        self._cancelled = False
        self._error: EngineError | None = None
        try:
            client._serving()
            self._wait.submit(
                client.keys.requests,
                Envelope.new(command, self.request_id, args, wait_s=client.command_timeout_s).encode(),
            )
        except EngineError as exc:
            self._error = exc

    def events(self, timeout_s: float | None = None) -> Iterator[GenerationEvent]:
        try:
            if self._error is not None:
                err = self._error
                yield ErrorEvent(self.request_id, err.code, err.message, err.details)
                return
            for item in self._wait.items(overall_s=None, idle_s=timeout_s):
                if isinstance(item, ResultEvent):  # a one-shot result cannot answer a generation
                    yield ErrorEvent(self.request_id, "generation_failed", "unexpected result entry", {})
                    return
                yield item
        finally:
            if not self._wait.done:
                self._wait.cancel()
            self._wait.close()

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._wait.cancel()


__all__ = ["RedisEngineClient"]
