"""The engine facade: one resident model, SAE attachments, per-request steering/monitoring.

All model work (forward passes, hook installation, loads) runs on one worker thread, fed
by a priority queue: control operations (load, unload, attach, detach) go ahead of queued
work but wait for the generation in flight, which is how attach/detach "drain" before
touching hooks.  Every wait a caller makes on the worker is bounded.  The web tier calls
this object directly (embedded mode) or through a transport that carries the protocol
dataclasses (``run_engine``); admission and backpressure are the caller's job.

With ``BatchingOptions(enabled=True)`` generations go to a ``BatchScheduler`` instead of
running one by one: the worker alternates between the queue's tasks and one batch step
at a time (blocking on the queue only when the batch is empty, so an idle batch costs
nothing), and a control operation first drains the running batch — no admissions,
bounded by the caller's wait — before it touches hooks or weights.

Apart from the facade and its worker: the ledger of accepted work and draining it
(``drain``), preparing a request for the model (``requests``), and an attached SAE
(``attachments``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Self

import msgspec
import torch

from . import requests
from .attachments import Attachment, is_out_of_memory, prepare_attachment
from .backends import backends_report, get_backend
from .backends.base import missing_members
from .commands import check_implements
from .drain import STOP_WAIT_S, WorkLedger
from .errors import (
    EngineBusy,
    EngineError,
    EngineShutdown,
    GenerationFailed,
    InsufficientMemory,
    InvalidParameter,
    ModelLoadFailed,
    ModelNotLoaded,
    SAENotAttached,
)
from .hooks import HookManager
from .protocol import (
    AttachmentKey,
    AttachmentStatus,
    AttachResult,
    AttachSpec,
    BatchingOptions,
    EmbedJob,
    EmbedResult,
    EngineEvent,
    EngineStatus,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    GenerationResult,
    HiddenStatesJob,
    HiddenStatesResult,
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    StructuredOutput,
    Usage,
)
from .sae import CompatibilityReport, check_compatibility
from .scheduler import BatchScheduler
from .stream import GenerationStream

log = logging.getLogger("gpu_engine")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# STRUCTURED_COMPILE_TIMEOUT_S: the longest a request's grammar may take to build
DEFAULT_STRUCTURED_TIMEOUT_S = 10.0
# while an idle batch waits for announced requests, the worker looks again this often
# (and at once when one is withdrawn: ``_WAKE``)
_GATHER_POLL_S = 0.005
_WAKE = object()
# the worker's queue order: commands, then interactive work, then Batch API work (the
# serial path's priority; the batch scheduler keeps its own order, scheduler.py)
_CONTROL, _WORK, _BATCH_WORK = 0, 1, 2


class _Task:
    __slots__ = ("control", "fn", "future", "on_drop")

    def __init__(self, fn: Callable[[], Any], on_drop: Callable[[], None] | None = None, *, control: bool = False) -> None:
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

    def __init__(self, engine: Engine) -> None:
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


class Engine:
    def __init__(
        self,
        *,
        on_event: Callable[[EngineEvent], None] | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        batching: BatchingOptions | None = None,
        idle_release_s: float | None = None,
        structured_timeout_s: float = DEFAULT_STRUCTURED_TIMEOUT_S,
    ) -> None:
        self.on_event = on_event
        self.drain_timeout_s = drain_timeout_s
        # TRANSFORMERS_IDLE_CACHE_RELEASE_S: after this many idle seconds the worker hands
        # the memory the backend keeps between requests back (None or negative: never)
        self.idle_release_s = idle_release_s if idle_release_s is not None and idle_release_s >= 0 else None
        self._used_since_release = False
        self._memory = {"idle_releases": 0, "released_bytes": 0}
        self.batching = batching or BatchingOptions()
        self._scheduler: BatchScheduler | None = None
        # True while the scheduler exists only for a batch-only backend (serial engine)
        self._backend_scheduler = False
        if self.batching.enabled:
            self._scheduler = BatchScheduler(self.batching, make_sequence=self._make_sequence, classify=self._classify)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._backend: Any = None
        self._model_id: str | None = None
        self._load_job: LoadModelJob | None = None
        self._hooks = HookManager()
        self._attachments: dict[AttachmentKey, Attachment] = {}
        self._in_flight = 0
        self._queued = 0
        # requests announced by the serving tier and not submitted yet (``arriving``), and
        # the worker's wait for them before an idle batch's first prefill (``_gather_wait``)
        self._arriving = 0
        self._gather_from: float | None = None
        self._gather_until: float | None = None
        self._gathers = {"gathers": 0, "gather_wait_ms": 0.0}
        self._closed = False
        # guards the attachment table and the counters, which status readers on other
        # threads look at while the worker changes them
        self._state_lock = threading.Lock()
        # Work accepted and not finished, whoever sent it: an unload or a model swap
        # drains it first (gpu_engine/drain.py)
        self._ledger = WorkLedger()
        # structured requests build their grammar here before they reach the worker
        # (``_prepare_structured``): built lazily, xgrammar is imported only then
        self.structured_timeout_s = structured_timeout_s
        self._grammar_builder: Any = None
        self._grammar_threads: ThreadPoolExecutor | None = None
        self._thread = threading.Thread(target=self._worker, name="millm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker

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

    def _next_task(self) -> tuple[Any, ...]:
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
        release_rows = getattr(runner, "release_cached", None)
        if release_rows is not None:
            freed += int(release_rows())
        release = getattr(self._backend, "release_cached_memory", None)
        if release is None and release_rows is None:
            return  # nothing this backend keeps (llama.cpp and vLLM manage their own)
        if release is not None:
            release()
        with self._state_lock:
            self._memory["idle_releases"] += 1
            self._memory["released_bytes"] += freed
        self._emit("memory:released", bytes=freed, model_id=self._model_id)

    def memory_status(self) -> dict[str, Any]:
        """What the backend keeps between requests now, and the idle releases so far."""
        runner = self._scheduler.backend if self._scheduler is not None else None
        cached = getattr(runner, "cached_bytes", None)
        with self._state_lock:
            data: dict[str, Any] = dict(self._memory)
        data["idle_release_s"] = self.idle_release_s
        data["cached_bytes"] = int(cached()) if cached is not None else None
        return data

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
        if left > 0 and self._arriving > 0 and len(sched.waiting) < self.batching.max_batch_size:
            return min(left, _GATHER_POLL_S)  # a withdrawn arrival is noticed within a poll
        if self._gather_from is not None:
            with self._state_lock:
                self._gathers["gathers"] += 1
                self._gathers["gather_wait_ms"] += (now - self._gather_from) * 1000
            self._gather_from = None
        self._gather_until = min(self._gather_until, now)  # no second wait for this start
        return 0.0

    def _batch_step(self, *, admit: bool) -> None:
        try:
            with torch.inference_mode():
                self._scheduler.step(admit=admit)  # type: ignore[union-attr]
        except BaseException as exc:  # a scheduler bug: end everything rather than spin on it
            log.exception("batch scheduler step failed")
            self._scheduler.abort_all(GenerationFailed(f"batch scheduler failed: {type(exc).__name__}: {exc}"))  # type: ignore[union-attr]

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
        if self._grammar_builder is not None:
            self._grammar_builder.close()
        if self._grammar_threads is not None:
            self._grammar_threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ model

    def _require_backend(self) -> Any:
        if self._backend is None:
            raise ModelNotLoaded("no model is loaded")
        return self._backend

    # ------------------------------------------------------------------ draining

    def _drained(self, reason: str, model_id: str | None, timeout_s: float | None, *, stop_after: bool,
                 op: Callable[[], Any]) -> Any:
        """Run control ``op`` once the work already accepted has finished (``WorkLedger.drained``)."""
        timeout = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        return self._ledger.drained(reason, model_id, timeout, stop_after=stop_after,
                                    run=lambda: self._call(op, timeout_s=max(timeout, STOP_WAIT_S)))

    def cancel_all(self, reason: str = "cancel_all") -> int:
        """Stop every running generation; their clients get ``engine_busy``."""
        return self._ledger.cancel_all(reason)

    # ------------------------------------------------------------------ model

    def check_load(self, job: LoadModelJob) -> None:
        """Refuse ``job`` as ``load_model`` would before anything drains (its backend not
        installed, its options, what the backend cannot honour: a quantization without a
        kernel, a pre-quantized checkpoint this host cannot load); nothing else happens.
        The web tier asks before it queues a load, so that such a load is a 400 at once."""
        entry = get_backend(job.backend)
        entry.require()
        entry.check_job(job)

    def load_model(self, job: LoadModelJob, *, timeout_s: float | None = None) -> EngineStatus:
        """Load ``job``'s model, replacing the resident one once the work running on it
        has finished (bounded by ``timeout_s``: engine_busy after, nothing replaced)."""

        entry = get_backend(job.backend)
        self.check_load(job)  # refused before anything drains

        def op() -> EngineStatus:
            self._unload()
            try:
                backend = entry.load(job, hooks=self._hooks)
            except Exception as exc:
                if is_out_of_memory(exc):
                    gc.collect()
                    raise InsufficientMemory(f"not enough memory to load {job.model_id}: {exc}") from exc
                raise
            missing = missing_members(backend)
            if missing:
                if callable(getattr(backend, "close", None)):
                    backend.close()
                raise ModelLoadFailed(f"the {entry.name} backend broke its contract (missing: {', '.join(missing)})")
            self._backend, self._model_id, self._load_job = backend, job.model_id, job
            if self._scheduler is None and not backend.capabilities().get("serial_mode", True):
                # a backend that only batches (vLLM) runs every generation through a batch
                # scheduler even on a serial engine; it goes with the backend (_unload)
                self._scheduler = BatchScheduler(msgspec.structs.replace(self.batching, enabled=True),
                                                 make_sequence=self._make_sequence, classify=self._classify)
                self._backend_scheduler = True
            if self._scheduler is not None:
                self._scheduler.set_backend(backend.batch_runner(
                    max_rows=self.batching.max_batch_size + self.batching.batch_rows))
            self._emit("model:load:complete", model_id=job.model_id)
            return self.status()

        return self._drained("loading", job.model_id, timeout_s, stop_after=False, op=op)

    def _unload(self) -> None:
        if self._backend is None:
            return
        self._detach_keys(list(self._attachments), reason="unload")
        backend, model_id = self._backend, self._model_id
        self._backend = self._model_id = self._load_job = None
        if self._scheduler is not None:
            self._scheduler.set_backend(None)
        if self._backend_scheduler:
            self._scheduler, self._backend_scheduler = None, False
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - a dead backend still leaves: nothing is resident
            log.exception("closing the %s backend failed; unloaded anyway", backend.name)
        gc.collect()
        self._emit("model:unload:complete", model_id=model_id)

    def unload_model(self, *, timeout_s: float | None = None) -> None:
        """Unload the resident model. New work is refused at once (engine_busy); work
        already accepted gets ``timeout_s`` (GRACEFUL_UNLOAD_TIMEOUT) to finish, then it
        is stopped and the unload goes ahead."""
        if self._backend is None:
            return
        self._drained("unloading", self._model_id, timeout_s, stop_after=True, op=self._unload)

    # ------------------------------------------------------------------ SAEs

    def check_sae(self, path: str, layer: int, *, layout: str | None = None) -> CompatibilityReport:
        """Compatibility of an SAE with the loaded model, from its metadata only."""
        from .errors import SAEIncompatible
        from .sae.layouts import config_at_layer, resolve_layout

        backend = self._require_backend()
        found_layout, found = resolve_layout(path, layout)
        try:
            cfg = config_at_layer(found_layout, found_layout.read_metadata(found), layer)
        except SAEIncompatible as exc:  # a vector file without that layer's vector
            return CompatibilityReport(False, errors=[exc.message])
        return check_compatibility(
            cfg, hidden_size=backend.hidden_size, num_layers=backend.num_layers, layer=layer, model_name=self._model_id
        )

    def attach_set(self, specs: Sequence[AttachSpec], *, timeout_s: float | None = None) -> list[AttachResult]:
        """Attach several SAEs all-or-nothing (an existing (sae_id, layer) is replaced)."""
        specs = list(specs)
        keys = [(s.sae_id, s.layer) for s in specs]
        if len(set(keys)) != len(keys):
            raise InvalidParameter("the set names one (sae_id, layer) twice", param="attachments")

        def op() -> list[AttachResult]:
            backend = self._require_backend()
            prepared = [prepare_attachment(backend, s, self._model_id) for s in specs]  # loads everything first
            installed: list[AttachmentKey] = []
            replaced: dict[AttachmentKey, Attachment] = {}
            try:
                for att, _ in prepared:
                    with self._state_lock:
                        old = self._attachments.pop(att.key, None)
                    if old is not None:
                        backend.detach(att.key)
                        replaced[att.key] = old
                    backend.attach(att)
                    with self._state_lock:
                        self._attachments[att.key] = att
                    installed.append(att.key)
            except BaseException:
                for key in installed:
                    backend.detach(key)
                    with self._state_lock:
                        self._attachments.pop(key, None)
                for key, old in replaced.items():
                    backend.attach(old)
                    with self._state_lock:
                        self._attachments[key] = old
                raise
            results = []
            for att, warnings in prepared:
                cfg = att.sae.cfg
                results.append(
                    AttachResult(att.sae_id, att.layer, att.layer_module_path, cfg.d_in, cfg.d_sae,
                                 cfg.activation, cfg.layout, warnings, hook_point=att.hook_point)
                )
                self._emit("sae:attached", sae_id=att.sae_id, layer=att.layer, layer_module_path=att.layer_module_path,
                           hook_point=att.hook_point)
            return results

        return self._call(op, timeout_s=timeout_s)

    def attach(self, spec: AttachSpec, *, timeout_s: float | None = None) -> AttachResult:
        return self.attach_set([spec], timeout_s=timeout_s)[0]

    def _detach_keys(self, keys: list[AttachmentKey], *, reason: str) -> list[AttachmentKey]:
        for key in keys:
            if self._backend is not None:
                try:
                    self._backend.detach(key)
                except Exception:  # noqa: BLE001 - a backend that died (vLLM's engine core)
                    # cannot run the hook any more either: the attachment is gone all the same
                    log.exception("detaching %s from the backend failed; forgotten anyway", key)
            with self._state_lock:
                self._attachments.pop(key, None)
        if keys and self._backend is not None and self._backend.device.type == "cuda":
            torch.cuda.empty_cache()
        for sae_id, layer in keys:
            self._emit("sae:detached", sae_id=sae_id, layer=layer, reason=reason)
        return keys

    def detach(self, sae_id: str | None = None, layer: int | None = None, *, timeout_s: float | None = None) -> list[AttachmentKey]:
        """Detach matching attachments (``sae_id=None``: all).  Unknown → SAENotAttached."""

        def op() -> list[AttachmentKey]:
            keys = [k for k in self._attachments if (sae_id is None or k[0] == sae_id) and (layer is None or k[1] == layer)]
            if not keys and sae_id is not None:
                raise SAENotAttached(f"SAE {sae_id!r}{'' if layer is None else f' at layer {layer}'} is not attached",
                                     details={"sae_id": sae_id, "layer": layer})
            return self._detach_keys(keys, reason="detach")

        return self._call(op, timeout_s=timeout_s)

    def attachments(self) -> list[AttachmentStatus]:
        with self._state_lock:
            current = list(self._attachments.values())
        return [a.status() for a in current]

    # ------------------------------------------------------------------ requests

    def _handle_oom(self, exc: BaseException) -> None:
        keys = list(self._attachments)
        log.error("out of memory during a forward pass (%s); detaching %d SAE(s)", exc, len(keys))
        gc.collect()
        if keys:
            self._detach_keys(keys, reason="out_of_memory")
        elif self._backend is not None and self._backend.device.type == "cuda":
            torch.cuda.empty_cache()
        self._emit("engine:out_of_memory", detached=[{"sae_id": s, "layer": l} for s, l in keys])

    def _run_generation(self, job: GenerationJob, stream: GenerationStream) -> None:
        if self._scheduler is not None:  # queued before a batch-only backend was loaded
            self._enqueue(job, stream)
            return
        with self._state_lock:
            self._in_flight += 1
        try:
            if stream.cancelled:
                stream._put(FinishEvent(job.request_id, "cancelled", "", [], Usage()))
                return
            backend = self._require_backend()
            requests.check_capabilities(backend, job)
            prompt_ids = requests.prompt_ids(backend, job)
            max_tokens = requests.token_budget(backend, job, len(prompt_ids))
            hooks = requests.request_hooks(backend, self._attachments, job, len(prompt_ids))
            hooks = requests.with_capture(backend, job, hooks, len(prompt_ids), max_tokens)
            finish = backend.generate(
                request_id=job.request_id, prompt_ids=prompt_ids, sampling=job.sampling, max_tokens=max_tokens,
                request_hooks=hooks, should_stop=stream._cancel.is_set, emit=stream._put,
            )
            stream._put(finish)
        except EngineError as exc:
            stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))
        except Exception as exc:
            if is_out_of_memory(exc):
                self._handle_oom(exc)
                err: EngineError = InsufficientMemory(
                    "out of memory during generation; attached SAEs were detached, the base model keeps serving"
                )
            else:
                log.exception("generation %s failed", job.request_id)
                err = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
        finally:
            with self._state_lock:
                self._in_flight -= 1

    def _make_sequence(self, job: GenerationJob, stream: GenerationStream) -> Any:
        """Validate a job against the loaded model and build its decode state (batched path;
        runs on the worker when the request gets a row, like the serial path's checks)."""
        backend = self._require_backend()
        requests.check_capabilities(backend, job)
        prompt_ids = requests.prompt_ids(backend, job)
        max_tokens = requests.token_budget(backend, job, len(prompt_ids))
        hooks = requests.request_hooks(backend, self._attachments, job, len(prompt_ids))
        hooks = requests.with_capture(backend, job, hooks, len(prompt_ids), max_tokens)
        return backend.new_sequence(job, prompt_ids=prompt_ids, max_tokens=max_tokens, request_hooks=hooks,
                                    emit=stream._put, should_stop=stream._cancel.is_set)

    def _classify(self, exc: BaseException) -> EngineError:
        if is_out_of_memory(exc):
            self._handle_oom(exc)
            return InsufficientMemory(
                "out of memory during generation; attached SAEs were detached, the base model keeps serving"
            )
        return GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")

    def _enqueue(self, job: GenerationJob, stream: GenerationStream) -> None:
        try:
            self._scheduler.enqueue(job, stream)  # type: ignore[union-attr]
        except EngineError as exc:
            stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))

    def generate(self, job: GenerationJob) -> GenerationStream:
        """Queue a generation; returns at once with a stream of its events."""
        stream = GenerationStream(job.request_id, on_end=self._ledger.ended)
        refused = self._ledger.admit(stream)
        if refused is not None:
            stream._put(ErrorEvent(job.request_id, refused.code, refused.message, refused.details))
            return stream

        def dropped() -> None:
            err = EngineShutdown("the engine shut down before the request ran")
            stream._put(ErrorEvent(job.request_id, err.code, err.message, {}))

        if job.sampling.structured is not None:
            self._prepare_structured(job, stream, dropped)
        else:
            self._submit_generation(job, stream, dropped)
        return stream

    def _submit_generation(self, job: GenerationJob, stream: GenerationStream, dropped: Callable[[], None]) -> None:
        if self._scheduler is not None:
            self._submit(lambda: self._enqueue(job, stream), _WORK, on_drop=dropped)
        else:
            self._submit(lambda: self._run_generation(job, stream), _priority(job.priority), on_drop=dropped)

    def _builder(self) -> Any:
        from .decode.grammar import GRAMMAR_WORKERS, GrammarBuilder

        with self._state_lock:
            if self._grammar_builder is None:
                self._grammar_builder = GrammarBuilder(timeout_s=self.structured_timeout_s)
                # one more thread than children: a request waiting for a free child
                # still counts its own deadline
                self._grammar_threads = ThreadPoolExecutor(GRAMMAR_WORKERS + 1, thread_name_prefix="millm-grammar")
            return self._grammar_builder

    def build_grammar(self, spec: StructuredOutput) -> None:
        """Build ``spec``'s grammar now, on the caller's thread (the web tier asks before a
        structured request takes an admission slot, so a costly schema holds no slot while
        it builds); ``SchemaTooComplex`` past ``structured_timeout_s``,
        ``ResponseFormatUnsupported`` for a schema xgrammar refuses.  The request's own
        ``generate`` then finds it built."""
        if self._closed:
            raise EngineShutdown("the engine is shut down")
        self._builder().build(spec)

    def _prepare_structured(self, job: GenerationJob, stream: GenerationStream, dropped: Callable[[], None]) -> None:
        """Build the request's grammar off the worker thread, then queue the request: a
        costly schema (xgrammar spends seconds to minutes on long regex repetitions) never
        holds the generation of others, and one not built within ``structured_timeout_s``
        ends as ``schema_too_complex`` (``gpu_engine.decode.grammar.GrammarBuilder``)."""
        builder, threads = self._builder(), self._grammar_threads

        def prepare() -> None:
            spec = job.sampling.structured
            try:
                if not stream.cancelled:
                    builder.build(spec)
                    grammars = getattr(self._backend, "structured_grammars", None)
                    if grammars is not None:
                        # the vocabulary's masks too (fast: xgrammar compiles from the
                        # grammar just built); vLLM compiles its own from the same grammar
                        grammars().compile(spec)
            except EngineError as exc:
                stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))
                return
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported on its stream
                log.exception("building the grammar of %s failed", job.request_id)
                err = GenerationFailed(f"building the grammar failed: {type(exc).__name__}: {exc}")
                stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
                return
            try:
                self._submit_generation(job, stream, dropped)
            except EngineShutdown:
                dropped()

        try:
            threads.submit(prepare)  # type: ignore[union-attr]
        except RuntimeError:  # the pool was shut down with the engine
            dropped()

    def generate_sync(self, job: GenerationJob, *, timeout_s: float | None = None) -> GenerationResult:
        return self.generate(job).result(timeout_s)

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

    def embed(self, job: EmbedJob, *, timeout_s: float | None = None) -> EmbedResult:
        def op() -> EmbedResult:
            backend = self._require_backend()
            if not backend.capabilities().get("embeddings", False):
                raise InvalidParameter(f"the {backend.name} backend does not compute embeddings", param="input",
                                       details={"backend": backend.name, "capability": "embeddings"})
            inputs = requests.encode_inputs(backend, job.inputs, "input")
            return backend.embed(job, inputs)

        return self._work(op, timeout_s, job.priority)

    def score(self, job: ScoreJob, *, timeout_s: float | None = None) -> ScoreResult:
        def op() -> ScoreResult:
            backend = self._require_backend()
            if not backend.capabilities().get("scoring", False):
                raise InvalidParameter(f"the {backend.name} backend does not score prompts", param="prompt",
                                       details={"backend": backend.name, "capability": "scoring"})
            if job.prompt_token_ids is not None:
                ids = requests.encode_inputs(backend, [list(job.prompt_token_ids)], "prompt")[0]
            elif job.messages is not None:
                ids = backend.encode_messages(job.messages, add_generation_prompt=True, **job.chat_template_kwargs)
                ids = requests.encode_inputs(backend, [ids], "messages")[0]
            else:
                ids = requests.encode_inputs(backend, [job.prompt], "prompt", job.add_special_tokens)[0]
            if job.allowed_token_ids is not None:
                requests.validate_ids(backend, job.allowed_token_ids, "allowed_token_ids")
            return backend.score(job, ids)

        return self._work(op, timeout_s)

    def hidden_states(self, job: HiddenStatesJob, *, timeout_s: float | None = None) -> HiddenStatesResult:
        """Pooled residuals after the given blocks, unsteered (``HiddenStatesJob``); a
        backend that cannot read them (capability ``hidden_states`` off) refuses."""

        def op() -> HiddenStatesResult:
            backend = self._require_backend()
            if not backend.capabilities().get("hidden_states", False):
                raise InvalidParameter(f"the {backend.name} backend cannot return hidden states "
                                       "(computing a steering vector needs the transformers backend)",
                                       param="layers", details={"backend": backend.name,
                                                                "capability": "hidden_states"})
            for layer in job.layers:
                if layer >= backend.num_layers:
                    raise InvalidParameter(f"layer {layer} is out of range: the model has {backend.num_layers} "
                                           f"decoder blocks (0..{backend.num_layers - 1})", param="layers",
                                           details={"layer": layer, "num_layers": backend.num_layers})
            inputs = requests.encode_inputs(backend, job.inputs, "inputs", job.add_special_tokens)
            return backend.hidden_states(job, inputs)

        return self._work(op, timeout_s, job.priority)

    # ------------------------------------------------------------------ status

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded) until the generation in flight finishes; False on timeout."""
        try:
            self._call(lambda: None, timeout_s=timeout_s)
            return True
        except EngineBusy:
            return False

    def batching_status(self) -> dict[str, Any]:
        """The generation mode and what the loaded backend can do per request, as the
        backend reports it (empty while no model is loaded)."""
        sched = self._scheduler
        backend = self._backend
        caps: dict[str, Any] = dict(backend.capabilities()) if backend is not None else {}
        if backend is not None:
            caps["shared_forward_passes"] = sched is not None
            caps["serial_fallback"] = False
        data: dict[str, Any] = {
            "enabled": sched is not None,
            "mode": "continuous_batching" if sched is not None else "serial",
            "capabilities": caps,
        }
        if sched is not None:
            data.update(sched.status())
            with self._state_lock:
                data.update(self._gathers, arriving=self._arriving, gather_ms=self.batching.gather_ms)
        return data

    def _in_flight_total(self) -> int:
        sched = self._scheduler
        # read without the worker's cooperation: a racy snapshot is fine for status
        extra = len(sched.running) + len(sched.waiting) if sched is not None else 0
        return self._in_flight + extra

    def status(self) -> EngineStatus:
        b = self._backend
        if b is None:
            return EngineStatus(state="empty", in_flight=self._in_flight_total(), queued=max(self._queued, 0),
                                batching=self.batching_status(), draining=self._ledger.draining,
                                backends=backends_report())
        return EngineStatus(
            state="ready", draining=self._ledger.draining, backend=b.name, model_id=self._model_id, model_path=str(self._load_job.path) if self._load_job else None,
            dtype=self._load_job.dtype if self._load_job else None, device=str(b.device), context_length=b.context_length,
            num_layers=b.num_layers, hidden_size=b.hidden_size, vocab_size=b.vocab_size,
            attachments=self.attachments(), in_flight=self._in_flight_total(), queued=max(self._queued, 0),
            batching=self.batching_status(), kernels=b.kernels, backends=backends_report(),
            memory=self.memory_status(), weights=dict(getattr(b, "weights", None) or {}),
        )

    @property
    def hook_manager(self) -> HookManager:
        return self._hooks

    @property
    def backend(self) -> Any:
        return self._backend

    @property
    def backend_name(self) -> str | None:
        backend = self._backend
        return backend.name if backend is not None else None


# every command of the protocol table is an Engine method with the declared arguments
check_implements(Engine)

__all__ = ["Arrival", "Attachment", "Engine", "GenerationStream", "is_out_of_memory"]
