"""The engine's worker thread and its queue: every piece of model work runs here, one at
a time, and every wait a caller makes on it is bounded.

Control operations (load, unload, attach, detach, drain) go ahead of queued work but wait
for the generation in flight, which is how attach/detach "drain" before touching hooks;
interactive work goes ahead of Batch API work.  With a batch scheduler the worker
alternates between the queue's tasks and one batch step at a time (blocking on the queue
only when the batch is empty, so an idle batch costs nothing), and a control operation
first drains the running batch (no admissions, bounded by the caller's wait).  Idle for
``idle_release_s``, the worker hands back what the backend keeps between requests.

``EngineWorker`` holds the state the facade (``runtime.engine.Engine``) builds in its
constructor; the classes of ``status`` and ``loading`` stack on it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any, Self

import torch

from ..backends.base import CachesRows, ModelBackend, ReleasesCachedMemory
from ..api.errors import EngineBusy, EngineError, EngineShutdown, GenerationFailed, ModelNotLoaded
from ..interp.hooks import HookManager
from ..api.protocol import BatchingOptions, EngineEvent, LoadModelJob
from .attachments import Attachment
from .capture_writer import CaptureWriter
from .drain import WorkLedger
from .scheduler import BatchScheduler, StepFigures

if TYPE_CHECKING:
    from ..decode.grammar import GrammarBuilder

log = logging.getLogger("gpu_engine")

# while an idle batch waits for announced requests, the worker looks again this often
# (and at once when one is withdrawn: ``_WAKE``)
_GATHER_POLL_S = 0.005
_WAKE = object()
# the worker's queue order: commands, then interactive work, then Batch API work (the
# serial path's priority; the batch scheduler keeps its own order, scheduler.py)
_CONTROL, _WORK, _BATCH_WORK = 0, 1, 2


class _Task:
    __slots__ = ("control", "fn", "future", "on_drop")

    def __init__(
        self, fn: Callable[[], Any], on_drop: Callable[[], None] | None = None, *, control: bool = False
    ) -> None:
        self.fn = fn
        self.future: Future = Future()
        self.on_drop = on_drop
        # control tasks (load, unload, attach, detach, drain) wait for the running batch
        self.control = control


def _priority(name: str) -> int:
    return _BATCH_WORK if name == "batch" else _WORK


class Arrival:
    """A generation the serving tier has accepted and is still preparing for this engine
    (``Engine.arriving``): until it is released, an idle batch about to prefill the
    requests already queued waits for it (``BatchingOptions.gather_ms``).  Release it once
    the request's jobs are submitted, or when the request ends without one; a second
    release does nothing."""

    __slots__ = ("_engine", "_open")

    def __init__(self, engine: EngineWorker) -> None:
        self._engine = engine
        self._open = True

    def release(self) -> None:
        engine = self._engine
        with engine._state_lock:
            if not self._open:
                return
            self._open = False
            engine._arriving -= 1
            waiting = engine._gather_until is not None
        if waiting:  # the worker is waiting for arrivals: have it look again now
            engine._queue.put((_WORK, next(engine._seq), _WAKE))

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EngineWorker:
    """The worker thread, its queue and the state they share (see the module doc)."""

    on_event: Callable[[EngineEvent], None] | None
    drain_timeout_s: float
    idle_release_s: float | None
    batching: BatchingOptions
    structured_timeout_s: float
    _used_since_release: bool
    _memory: dict[str, int]
    _scheduler: BatchScheduler | None
    # step time and tokens of every generation, batched or serial (engine metrics)
    _steps: StepFigures
    # True while the scheduler exists only for a batch-only backend (serial engine)
    _backend_scheduler: bool
    _queue: queue.PriorityQueue[tuple[int, int, Any]]
    _seq: itertools.count[int]
    _backend: ModelBackend | None
    _model_id: str | None
    _load_job: LoadModelJob | None
    _hooks: HookManager
    _attachments: dict[tuple[str, int], Attachment]
    _in_flight: int
    _queued: int
    _arriving: int
    _gather_from: float | None
    _gather_until: float | None
    _gathers: dict[str, float]
    _closed: bool
    _state_lock: threading.Lock
    _ledger: WorkLedger
    _grammar_builder: GrammarBuilder | None
    _grammar_threads: ThreadPoolExecutor | None
    _thread: threading.Thread
    _capture_writer: CaptureWriter
    # unloads the resident model on shutdown (``runtime.loading.ModelLoading``)
    _unload: Callable[[], None]

    def _worker(self) -> None:
        while True:
            # read each turn: a batch-only backend brings its own scheduler (load_model)
            sched = self._scheduler
            if sched is not None and sched.busy:
                # a batch is running: take queued tasks between its steps, never block —
                # except before an idle batch's first prefill while announced requests are
                # still on their way (``_gather_wait``)
                wait = self._gather_wait(sched)
                try:
                    _, _, task = self._queue.get(timeout=wait) if wait else self._queue.get_nowait()
                except queue.Empty:
                    if not wait:
                        self._batch_step(admit=True)
                    continue
            else:
                _, _, task = self._next_task()
            if task is None:
                break
            if task is _WAKE:
                continue
            self._used_since_release = True
            with self._state_lock:
                self._queued -= 1
            if sched is not None and task.control:
                # drain: let the running rows finish (admitting nobody) unless the caller
                # stops waiting, in which case the task is withdrawn and batching resumes
                while sched.running and not task.future.cancelled():
                    self._batch_step(admit=False)
            if not task.future.set_running_or_notify_cancel():
                if task.on_drop:
                    task.on_drop()
                continue
            try:
                task.future.set_result(task.fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller; the worker lives on
                task.future.set_exception(exc)
        # drop whatever is left so no caller waits forever
        while True:
            try:
                _, _, task = self._queue.get_nowait()
            except queue.Empty:
                break
            if task is not None and task is not _WAKE and task.future.cancel() and task.on_drop:
                task.on_drop()
        if self._scheduler is not None:
            self._scheduler.abort_all(EngineShutdown("the engine shut down before the request finished"))

    def _next_task(self) -> tuple[int, int, Any]:
        """The next queued task, waiting for it; once the engine has been idle (nothing
        running, nothing queued) for ``idle_release_s`` since it last worked, the memory the
        backend keeps between requests is released first, on this thread: so never during
        a request, and a task that arrives before the period ends simply cancels it."""
        if self.idle_release_s is None or not self._used_since_release or self._backend is None:
            return self._queue.get()
        try:
            return self._queue.get(timeout=self.idle_release_s)
        except queue.Empty:
            try:
                with torch.inference_mode():
                    self._release_idle()
            except Exception:  # noqa: BLE001 - a failed release must not stop the worker
                log.exception("idle memory release failed")
            return self._queue.get()

    def _release_idle(self) -> None:
        self._used_since_release = False
        freed = 0
        runner = self._scheduler.backend if self._scheduler is not None else None
        rows = runner if isinstance(runner, CachesRows) else None
        backend = self._backend if isinstance(self._backend, ReleasesCachedMemory) else None
        if rows is None and backend is None:
            return  # nothing this backend keeps (llama.cpp and vLLM manage their own)
        if rows is not None:
            freed += int(rows.release_cached())
        if backend is not None:
            backend.release_cached_memory()
        with self._state_lock:
            self._memory["idle_releases"] += 1
            self._memory["released_bytes"] += freed
        self._emit("memory:released", bytes=freed, model_id=self._model_id)

    def arriving(self) -> Arrival:
        """Announce a generation request the caller has accepted and will submit soon
        (the serving tier calls this as a request comes in, and releases it once the
        request's jobs are queued: ``Arrival``).  A burst of requests then starts as one
        batch: the first prefill of an idle batch waits up to ``BatchingOptions.gather_ms``
        while announced requests are still being prepared."""
        with self._state_lock:
            self._arriving += 1
        return Arrival(self)

    def _gather_wait(self, sched: BatchScheduler) -> float:
        """How long the worker may still wait for announced requests before it starts an
        idle batch (0: start now).  Only before the first prefill of a batch with nothing
        running, at most ``gather_ms`` in all, and over as soon as nothing announced is
        outstanding or the waiting requests fill the batch; one wait per batch start."""
        if sched.running or not sched.waiting:
            self._gather_until = None
            return 0.0
        now = time.monotonic()
        if self._gather_until is None:
            if self.batching.gather_ms <= 0:
                return 0.0
            with self._state_lock:  # with ``Arrival.release``: it sees this wait or we see it
                if self._arriving <= 0:
                    return 0.0
                self._gather_from = now
                self._gather_until = now + self.batching.gather_ms / 1000
        left = self._gather_until - now
        if left > 0 and self._arriving > 0 and len(sched.waiting) < sched.options.max_batch_size:
            return min(left, _GATHER_POLL_S)  # a withdrawn arrival is noticed within a poll
        if self._gather_from is not None:
            with self._state_lock:
                self._gathers["gathers"] += 1
                self._gathers["gather_wait_ms"] += (now - self._gather_from) * 1000
            self._gather_from = None
        self._gather_until = min(self._gather_until, now)  # no second wait for this start
        return 0.0

    def _batch_step(self, *, admit: bool) -> None:
        sched = self._scheduler
        assert sched is not None  # only called while a batch runs
        try:
            with torch.inference_mode():
                sched.step(admit=admit)
        except BaseException as exc:  # a scheduler bug: end everything rather than spin on it
            log.exception("batch scheduler step failed")
            sched.abort_all(GenerationFailed(f"batch scheduler failed: {type(exc).__name__}: {exc}"))

    def _submit(self, fn: Callable[[], Any], priority: int, on_drop: Callable[[], None] | None = None) -> _Task:
        if self._closed:
            raise EngineShutdown("the engine is shut down")
        task = _Task(fn, on_drop, control=priority == _CONTROL)
        with self._state_lock:
            self._queued += 1
        self._queue.put((priority, next(self._seq), task))
        return task

    def _call(self, fn: Callable[[], Any], *, priority: int = _CONTROL, timeout_s: float | None = None) -> Any:
        """Run ``fn`` on the worker; wait at most ``timeout_s`` for it to *start*."""
        task = self._submit(fn, priority)
        try:
            return task.future.result(timeout=self.drain_timeout_s if timeout_s is None else timeout_s)
        except FutureTimeout:
            if task.future.cancel():
                raise EngineBusy(
                    "timed out waiting for in-flight work to drain",
                    details={"timeout_s": self.drain_timeout_s if timeout_s is None else timeout_s},
                ) from None
            return task.future.result()  # already running: a control op is short

    def _emit(self, name: str, **data: Any) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(EngineEvent(name, data))
        except Exception:  # a listener's bug must not break the engine
            log.exception("engine event listener failed for %s", name)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        try:
            self._call(self._unload, timeout_s=timeout_s)
        except EngineError:
            log.warning("engine shutdown: unload did not run within %ss", timeout_s)
        self._closed = True
        self._queue.put((-1, next(self._seq), None))
        self._thread.join(timeout=timeout_s)
        # the artifacts of requests that finished are written (or, past the wait, failed
        # with engine_shutdown) before their final events: none is lost unannounced
        self._capture_writer.close(timeout_s)
        if self._grammar_builder is not None:
            self._grammar_builder.close()
        if self._grammar_threads is not None:
            self._grammar_threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _require_backend(self) -> ModelBackend:
        if self._backend is None:
            raise ModelNotLoaded("no model is loaded")
        dead = backend_failure(self._backend)
        if dead is not None:
            raise dead
        return self._backend

    def _work(self, fn: Callable[[], Any], timeout_s: float | None, priority: str = "interactive") -> Any:
        refused = self._ledger.admit()
        if refused is not None:
            raise refused
        try:
            task = self._submit(fn, _priority(priority))
            try:
                return task.future.result(timeout=timeout_s)
            except FutureTimeout:
                task.future.cancel()
                raise EngineBusy("timed out waiting for the engine", details={"timeout_s": timeout_s}) from None
        finally:
            self._ledger.ended()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded) until the generation in flight finishes; False on timeout."""
        try:
            self._call(lambda: None, timeout_s=timeout_s)
            return True
        except EngineBusy:
            return False


def backend_failure(backend: Any) -> EngineShutdown | None:
    """The refusal of every command while ``backend`` cannot serve (vLLM's engine core
    died: ``failure()``), naming why; None while it can. 503 ``engine_unavailable`` at
    the web tier until the model is unloaded or loaded again."""
    check = getattr(backend, "failure", None)
    reason = check() if check is not None else None
    if reason is None:
        return None
    return EngineShutdown(
        f"the resident model's backend cannot serve: {reason}; unload the model or load it again",
        details={"failure": reason},
    )


__all__ = ["Arrival", "EngineWorker", "backend_failure"]
