"""The engine process's main loop over Redis Streams (consumer group ``engines``).

Delivery semantics (docs/deploy.md has the long form):

- A job is read with XREADGROUP only when the engine has room for it (at most
  ``max_in_flight`` jobs at once), so a job waiting for room stays in the stream, where
  the next engine can read it if this one dies.
- Before a job reaches the model the engine records ``started:<request_id>`` with SET NX.
  A job whose marker already exists is never run again: its client gets an error and
  the entry goes to the dead-letter stream. No request is generated twice.
- Tokens go to the request's own stream as they come; the job is acknowledged (XACK, and
  XDEL from the request stream) in the same MULTI as the final result, so a job is
  acknowledged only once its result is stored.
- Entries a dead engine read but never acknowledged are reclaimed with XAUTOCLAIM once
  idle for ENGINE_DEAD_AFTER_S. A live engine keeps the idle time of the entries it is
  working on near zero (XCLAIM JUSTID to itself on every heartbeat), so only a dead
  engine's entries are ever reclaimed. An entry delivered more than ``max_deliveries``
  times goes to the dead-letter stream and its client gets an error.
- The heartbeat (a key with a TTL of ENGINE_DEAD_AFTER_S, rewritten every
  ENGINE_HEARTBEAT_S) holds the engine's status; the web tier reads it to answer at once
  and to notice a dead engine while it waits for tokens.
- A client keeps ``live:<request_id>`` alive while it waits; the engine checks those keys
  every ``cancel_poll_s`` and cancels the generations whose client left (a disconnect, a
  killed web worker), which then stop before their next decode step.

Commands are dispatched from the one table ``gpu_engine.api.commands.COMMANDS``: an entry
names a command, its arguments are decoded into the declared struct and the same
``Command.call`` the embedded client uses runs them on the engine; the result goes back
as JSON of the declared result type. ``state`` commands (``status``) are not sent at all:
the heartbeat carries their latest results under their names.

Framework-free: no Django, and no torch import here (the caller builds the ``Engine``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from ..api.commands import COMMANDS, Command, Lane
from ..api.errors import (
    EngineError,
    EngineShutdown,
    GenerationFailed,
    InvalidParameter,
)
from ..api.protocol import ErrorEvent, FinishEvent, StreamEvent, to_builtins
from ..api.transport import Envelope, Keys, error_event, job_error, result_event
from .config import ServerConfig
from .delivery import Delivery, read_entries
from .ownership import EngineAlreadyRunning, PrefixOwnership
from .results import ResultWriter

log = logging.getLogger("gpu_engine.server")

READ_BLOCK_MS = 500


@dataclass
class _InFlight:
    msg_id: str
    stream: str  # the stream the entry came from (requests or commands)
    request_id: str
    kind: str
    handle: Any = None  # GenerationStream for generations
    fail_with: EngineError | None = None  # shutdown: the error to send
    cancel_sent: bool = False
    started_at: float = field(default_factory=time.monotonic)


class EngineServer:
    """Serve one ``Engine`` to the web tier over Redis Streams (see the module doc)."""

    def __init__(
        self,
        engine: Any,
        client: redis.Redis,
        config: ServerConfig | None = None,
        *,
        engine_id: str | None = None,
        describe: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.redis = client
        self.config = config or ServerConfig()
        self.keys = Keys(self.config.prefix)
        self.engine_id = engine_id or (f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.describe = describe or dict
        self.phase = "starting"
        self.started_at = time.time()
        self.lost_ownership = False
        self._stopping = threading.Event()  # no new work
        self._closed = threading.Event()  # helpers (heartbeat, watcher) end
        self._lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._inflight: dict[str, _InFlight] = {}
        self._command: _InFlight | None = None
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_in_flight, thread_name_prefix="millm-job")
        self._threads: list[threading.Thread] = []
        self._heartbeat_thread: threading.Thread | None = None
        self._results = ResultWriter(client, self.keys, self.config, self.engine_id)
        self._delivery = Delivery(client, self.keys, self.config, self.engine_id, self._results)
        self._owner = PrefixOwnership(client, self.keys, self.engine_id, dead_after_ms=self.config.dead_after_ms)

    # ------------------------------------------------------------------ lifecycle

    def acquire_ownership(self, wait_s: float | None = None) -> None:
        """Become the one engine of this prefix, waiting (bounded) for a dead one's claim
        to expire; raise EngineAlreadyRunning if another engine is still alive."""
        wait_s = self.config.dead_after_s * 2 if wait_s is None else wait_s
        self._owner.acquire(wait_s, poll_s=min(0.2, self.config.heartbeat_s))

    def ensure_groups(self) -> None:
        for stream in (self.keys.commands, self.keys.requests):
            try:
                # "0": entries queued before any engine ever ran are read too
                self.redis.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def start_heartbeat(self, phase: str = "restoring") -> None:
        self.phase = phase
        self.heartbeat_once()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="millm-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def begin_restore(self) -> int:
        """Count a start-up that begins restoring state; the count survives a crash, so a
        state that kills the engine is noticed instead of retried for ever."""
        pipe = self.redis.pipeline()
        pipe.incr(self.keys.restore_attempts)
        pipe.expire(self.keys.restore_attempts, 3600)
        return int(pipe.execute()[0])

    def end_restore(self) -> None:
        self.redis.delete(self.keys.restore_attempts)

    def run(
        self, stop: threading.Event, *, restore: Callable[[], None] | None = None, ownership_wait_s: float | None = None
    ) -> None:
        """Own the prefix, restore (``restore()``, with the heartbeat saying so), serve
        until ``stop`` is set (or ownership is lost), then shut down cleanly."""
        self.acquire_ownership(ownership_wait_s)
        self.ensure_groups()
        self.start_heartbeat("restoring")
        try:
            if restore is not None:
                restore()
            self.serve(stop)
        finally:
            self.close()

    def serve(self, stop: threading.Event) -> None:
        self.ensure_groups()
        self.phase = "serving"
        self.heartbeat_once()
        for target, name in (
            (self._request_loop, "millm-requests"),
            (self._command_loop, "millm-commands"),
            (self._watch_loop, "millm-cancel-watch"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "engine_serving engine_id=%s prefix=%s max_in_flight=%d",
            self.engine_id,
            self.config.prefix,
            self.config.max_in_flight,
        )
        while not stop.is_set() and not self._stopping.is_set():
            stop.wait(0.25)
        self.shutdown()

    def shutdown(self) -> None:
        """Stop reading; let in-flight work finish within shutdown_grace_s, then fail the
        rest with engine_shutdown (their clients get that error, the entries are acked)."""
        if self.phase == "stopped":
            return
        self.phase = "stopping"
        self._stopping.set()
        self._safe_heartbeat()
        for thread in self._threads:
            if thread.name != "millm-cancel-watch":
                thread.join(timeout=READ_BLOCK_MS / 1000 + 2)
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        leftover = self._fail_all(
            EngineShutdown("the engine process is shutting down; the request was stopped and will not be run again")
        )
        if leftover:
            log.warning("engine_shutdown_failed_requests count=%d", leftover)
        deadline = time.monotonic() + 10.0
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.phase = "stopped"

    def close(self) -> None:
        """End the helpers and give the prefix back (heartbeat and owner keys)."""
        if self.phase not in ("stopped",):
            self.shutdown()
        self._closed.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=self.config.heartbeat_s + 2)
        for thread in self._threads:
            thread.join(timeout=2)
        try:
            self._owner.release()
        except redis.RedisError as exc:
            log.warning("engine_release_failed error=%r", exc)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight) + (1 if self._command is not None else 0)

    # ------------------------------------------------------------------ heartbeat

    def heartbeat_payload(self) -> dict[str, Any]:
        with self._lock:
            jobs = len(self._inflight)
        return {
            "engine_id": self.engine_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "phase": self.phase,
            "started_at": self.started_at,
            "time": time.time(),
            "in_flight_jobs": jobs,
            "max_in_flight": self.config.max_in_flight,
            "heartbeat_s": self.config.heartbeat_s,
            # the ``state`` commands' latest results, under their names (``status``)
            **{c.name: to_builtins(c.call(self.engine, c.args())) for c in COMMANDS.values() if c.lane is Lane.STATE},
            **self.describe(),
        }

    def heartbeat_once(self) -> None:
        # reading the status and writing it happen under one lock: the loop's beat, read
        # during a drain, must not land after the beat a finished command wrote (clients
        # would see "draining" for a heartbeat period after the unload ended)
        with self._beat_lock:
            payload = json.dumps(self.heartbeat_payload(), separators=(",", ":"))
            owned = self._owner.beat(payload)
        if not owned:
            if not self.lost_ownership:
                log.critical(
                    "engine_ownership_lost engine_id=%s: another engine took the "
                    "prefix %r while this one stalled; stopping",
                    self.engine_id,
                    self.config.prefix,
                )
            self.lost_ownership = True
            self._stopping.set()
            return
        # keep the entries this engine works on from looking abandoned
        with self._lock:
            held = [(e.stream, e.msg_id) for e in self._inflight.values()]
            if self._command is not None:
                held.append((self._command.stream, self._command.msg_id))
        if held:
            pipe = self.redis.pipeline(transaction=False)
            for stream, msg_id in held:
                pipe.xclaim(stream, self.keys.group, self.engine_id, 0, [msg_id], justid=True)
            pipe.execute()

    def _safe_heartbeat(self) -> bool:
        try:
            self.heartbeat_once()
            return True
        except redis.RedisError as exc:
            log.warning("engine_heartbeat_failed error=%r", exc)
        except Exception:  # noqa: BLE001 - a status read must not end the heartbeat
            log.exception("engine_heartbeat_failed")
        return False

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.config.heartbeat_s):
            if self.phase != "stopped":
                self._safe_heartbeat()

    # ------------------------------------------------------------------ reading

    def _room_left(self, timeout_s: float) -> int:
        with self._room:
            if len(self._inflight) >= self.config.max_in_flight:
                self._room.wait(timeout_s)
            return self.config.max_in_flight - len(self._inflight)

    def _guarded(self, loop_name: str, step: Callable[[], None]) -> None:
        """Run ``step`` until stopping; Redis outages are retried with backoff and every
        failure is logged (an engine never spins or dies silently)."""
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                step()
                backoff = 0.1
            except redis.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    log.warning("engine_group_missing loop=%s: recreating", loop_name)
                    self._retry(self.ensure_groups)
                else:
                    log.error("engine_redis_error loop=%s error=%r", loop_name, exc)
                    time.sleep(backoff)
            except redis.RedisError as exc:
                log.warning("engine_redis_unavailable loop=%s error=%r retry_in=%.1fs", loop_name, exc, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # noqa: BLE001 - logged; the loop keeps serving
                log.exception("engine_loop_error loop=%s", loop_name)
                self._stopping.wait(1.0)

    def _retry(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except redis.RedisError as exc:
            log.warning("engine_retry_failed error=%r", exc)

    def _request_loop(self) -> None:
        next_reclaim = [0.0]

        def step() -> None:
            now = time.monotonic()
            if now >= next_reclaim[0]:
                next_reclaim[0] = now + max(self.config.heartbeat_s, self.config.dead_after_s / 2)
                self._delivery.reclaim(
                    self.keys.requests,
                    self._accept_request,
                    room=lambda: max(self.config.max_in_flight - self.in_flight(), 0),
                    stopping=self._stopping,
                )
            room = self._room_left(0.5)
            if room <= 0 or self._stopping.is_set():
                return
            response = self.redis.xreadgroup(
                self.keys.group, self.engine_id, {self.keys.requests: ">"}, count=room, block=READ_BLOCK_MS
            )
            for _, entries in read_entries(response):
                for msg_id, fields in entries:
                    self._accept_request(msg_id, fields, 1)

        self._guarded("requests", step)

    def _command_loop(self) -> None:
        next_reclaim = [0.0]

        def step() -> None:
            now = time.monotonic()
            if now >= next_reclaim[0]:
                next_reclaim[0] = now + max(self.config.heartbeat_s, self.config.dead_after_s / 2)
                self._delivery.reclaim(
                    self.keys.commands, self._accept_command, room=lambda: 1, stopping=self._stopping
                )
            response = self.redis.xreadgroup(
                self.keys.group, self.engine_id, {self.keys.commands: ">"}, count=1, block=READ_BLOCK_MS
            )
            for _, entries in read_entries(response):
                for msg_id, fields in entries:
                    self._accept_command(msg_id, fields, 1)

        self._guarded("commands", step)

    # ------------------------------------------------------------------ requests

    def _accept_request(self, msg_id: str, fields: Any, delivered: int) -> None:
        env = self._delivery.decode(self.keys.requests, msg_id, fields)
        if env is None:
            return
        rid = env.request_id
        if not self._delivery.claim_start(self.keys.requests, msg_id, fields, rid, delivered, env.deadline):
            return
        entry = _InFlight(msg_id, self.keys.requests, rid, env.kind)
        with self._lock:
            self._inflight[rid] = entry
        try:
            cmd = _on_lane(env, Lane.WORK, Lane.STREAM)
            args = cmd.with_timeout(env.build_args(), self.config.event_timeout_s)
            if cmd.lane is Lane.STREAM:
                entry.handle = cmd.call(self.engine, args)
                self._pool.submit(self._pump, entry)
            else:
                self._pool.submit(self._call, entry, cmd, args)
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            self._finish(entry, error_event(rid, job_error(exc)))
            self._done(entry)

    def _pump(self, entry: _InFlight) -> None:
        rid = entry.request_id
        final: StreamEvent | None = None
        try:
            for event in entry.handle.events(self.config.event_timeout_s):
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    final = event
                    break
                self._results.emit(rid, event)
        except EngineError as exc:
            final = error_event(rid, exc)
        except redis.RedisError as exc:
            # tokens cannot be delivered: stop the generation; the entry stays pending and
            # is settled (error to the client) when it is reclaimed
            log.error("engine_stream_write_failed request_id=%s error=%r", rid, exc)
            entry.handle.cancel()
            self._done(entry)
            return
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            log.exception("engine_pump_failed request_id=%s", rid)
            final = error_event(rid, GenerationFailed(f"{type(exc).__name__}: {exc}"))
        if final is None:
            final = error_event(rid, GenerationFailed("the generation ended without a result"))
        if entry.fail_with is not None and not (isinstance(final, FinishEvent) and final.finish_reason != "cancelled"):
            final = error_event(rid, entry.fail_with)
        self._finish(entry, final)
        self._done(entry)

    def _call(self, entry: _InFlight, cmd: Command, args: Any) -> None:
        rid = entry.request_id
        payload: StreamEvent
        try:
            payload = result_event(rid, cmd.call(self.engine, args))
        except EngineError as exc:
            payload = error_event(rid, exc)
        except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
            log.exception("engine_call_failed request_id=%s", rid)
            payload = error_event(rid, GenerationFailed(f"{type(exc).__name__}: {exc}"))
        self._finish(entry, payload)
        self._done(entry)

    def _done(self, entry: _InFlight) -> None:
        with self._room:
            self._inflight.pop(entry.request_id, None)
            self._room.notify_all()

    def _finish(self, entry: _InFlight, payload: StreamEvent) -> None:
        self._results.store_final(entry.stream, entry.msg_id, entry.request_id, payload)

    # ------------------------------------------------------------------ cancellation

    def _watch_loop(self) -> None:
        while not self._closed.wait(self.config.cancel_poll_s):
            with self._lock:
                watched = [e for e in self._inflight.values() if e.handle is not None and not e.cancel_sent]
            if not watched:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                for e in watched:
                    pipe.exists(self.keys.live(e.request_id))
                alive = pipe.execute()
            except redis.RedisError as exc:
                log.warning("engine_cancel_watch_failed error=%r", exc)
                continue
            for e, live in zip(watched, alive, strict=True):
                if not live:
                    log.info("engine_cancelled_by_client request_id=%s", e.request_id)
                    e.cancel_sent = True
                    e.handle.cancel()

    def _fail_all(self, error: EngineError) -> int:
        with self._lock:
            entries = [e for e in self._inflight.values() if e.handle is not None]
        for e in entries:
            e.fail_with = error
            e.cancel_sent = True
            e.handle.cancel()
        return len(entries)

    # ------------------------------------------------------------------ commands

    def _accept_command(self, msg_id: str, fields: Any, delivered: int) -> None:
        env = self._delivery.decode(self.keys.commands, msg_id, fields)
        if env is None:
            return
        cid = env.request_id
        if not self._delivery.claim_start(self.keys.commands, msg_id, fields, cid, delivered, env.deadline):
            return
        entry = _InFlight(msg_id, self.keys.commands, cid, env.kind)
        with self._lock:
            self._command = entry
        payload: StreamEvent
        try:
            cmd = _on_lane(env, Lane.CONTROL)
            args = env.build_args()
            log.info("engine_command kind=%s command_id=%s", env.kind, cid)
            payload = result_event(cid, cmd.call(self.engine, args))
        except EngineError as exc:
            payload = error_event(cid, exc)
        except Exception as exc:  # noqa: BLE001 - the caller gets it as an error reply
            log.exception("engine_command_failed kind=%s", env.kind)
            payload = error_event(cid, GenerationFailed(f"command {env.kind} failed: {type(exc).__name__}: {exc}"))
        # the status clients read next must already show what the command changed
        self._safe_heartbeat()
        self._finish(entry, payload)
        with self._lock:
            self._command = None


def _on_lane(env: Envelope, *lanes: Lane) -> Command:
    """The envelope's command, refused (to its caller) when it is unknown here or does
    not travel on this stream."""
    cmd = env.command
    if cmd.lane not in lanes:
        raise InvalidParameter(f"engine command {cmd.name!r} travels on the {cmd.lane} lane", param="kind")
    return cmd


__all__ = ["EngineAlreadyRunning", "EngineServer"]
