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
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from .commands import check_implements
from .errors import (
    ContextLengthExceeded,
    EngineBusy,
    EngineError,
    EngineShutdown,
    GenerationFailed,
    InsufficientMemory,
    InvalidParameter,
    ModelNotLoaded,
    SAENotAttached,
)
from .hooks import AttachmentPlan, AttachmentStats, HookManager, MonitorPlan, RequestHooks
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
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    Usage,
)
from .sae import CompatibilityReport, check_compatibility
from .sae.layouts import detect_layout, get_layout
from .sae.module import SAE
from .scheduler import BatchScheduler
from .stream import GenerationStream

log = logging.getLogger("gpu_engine")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# How long stopped generations get to end (they stop before their next forward pass) and a
# control operation gets to start after a drain, at least.
STOP_WAIT_S = 10.0
_CONTROL, _WORK = 0, 1


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@dataclass
class Attachment:
    sae_id: str
    layer: int
    layer_module_path: str
    sae: SAE
    module: Any
    stats: AttachmentStats = field(default_factory=AttachmentStats)

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)

    def status(self) -> AttachmentStatus:
        cfg = self.sae.cfg
        return AttachmentStatus(
            sae_id=self.sae_id, layer=self.layer, layer_module_path=self.layer_module_path,
            d_in=cfg.d_in, d_sae=cfg.d_sae, activation=cfg.activation, layout=cfg.layout,
            path=cfg.path, steering_apply_count=self.stats.steering_apply_count,
        )


class _Task:
    __slots__ = ("control", "fn", "future", "on_drop")

    def __init__(self, fn: Callable[[], Any], on_drop: Callable[[], None] | None = None, *, control: bool = False) -> None:
        self.fn = fn
        self.future: Future = Future()
        self.on_drop = on_drop
        # control tasks (load, unload, attach, detach, drain) wait for the running batch
        self.control = control


class Engine:
    def __init__(
        self,
        *,
        on_event: Callable[[EngineEvent], None] | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        batching: BatchingOptions | None = None,
    ) -> None:
        self.on_event = on_event
        self.drain_timeout_s = drain_timeout_s
        self.batching = batching or BatchingOptions()
        self._scheduler: BatchScheduler | None = None
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
        self._closed = False
        # guards the attachment table and the counters, which status readers on other
        # threads look at while the worker changes them
        self._state_lock = threading.Lock()
        # Work accepted and not finished (generations until their last event, embeddings
        # and scores until answered), whoever sent it: an unload or a model swap waits
        # for these, wherever it was asked from. While ``_draining`` names such an
        # operation, new work is refused with engine_busy (503 model_busy on /v1).
        self._work_cv = threading.Condition()
        self._streams: set[GenerationStream] = set()
        self._calls = 0
        self._draining: str | None = None
        self._draining_model: str | None = None
        self._thread = threading.Thread(target=self._worker, name="millm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker

    def _worker(self) -> None:
        sched = self._scheduler
        while True:
            if sched is not None and sched.busy:
                # a batch is running: take queued tasks between its steps, never block
                try:
                    _, _, task = self._queue.get_nowait()
                except queue.Empty:
                    self._batch_step(admit=True)
                    continue
            else:
                _, _, task = self._queue.get()
            if task is None:
                break
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
            if task is not None and task.future.cancel() and task.on_drop:
                task.on_drop()
        if sched is not None:
            sched.abort_all(EngineShutdown("the engine shut down before the request finished"))

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

    def _live_work(self) -> int:
        return len(self._streams) + self._calls

    def _admit_work(self, stream: GenerationStream | None = None) -> EngineBusy | None:
        """Count new work in, or say why it is refused (a drain is under way)."""
        with self._work_cv:
            if self._draining is not None:
                return EngineBusy(
                    f"the engine is {self._draining} model {self._draining_model!r}; retry shortly",
                    details={"reason": self._draining, "model_id": self._draining_model})
            if stream is None:
                self._calls += 1
            else:
                self._streams.add(stream)
            return None

    def _work_ended(self, stream: GenerationStream | None = None) -> None:
        with self._work_cv:
            if stream is None:
                self._calls -= 1
            else:
                self._streams.discard(stream)
            self._work_cv.notify_all()

    def _wait_for_work(self, deadline: float) -> bool:
        """Wait until no accepted work is left, or ``deadline``; True when none is left."""
        with self._work_cv:
            while self._live_work():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._work_cv.wait(left)
            return True

    def _drained(self, reason: str, model_id: str | None, timeout_s: float | None, *, stop_after: bool,
                 op: Callable[[], Any]) -> Any:
        """Run control ``op`` once the work already accepted has finished: new work is
        refused from now on; what is still running after ``timeout_s`` is stopped (its
        clients get engine_busy) when ``stop_after``, else the operation is refused with
        engine_busy and serving resumes."""
        timeout = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        with self._work_cv:
            if self._draining is not None:
                raise EngineBusy(f"the engine is already {self._draining} model {self._draining_model!r}",
                                 details={"reason": self._draining})
            self._draining, self._draining_model = reason, model_id
        try:
            if not self._wait_for_work(time.monotonic() + timeout):
                if not stop_after:
                    raise EngineBusy("timed out waiting for in-flight work to drain",
                                     details={"timeout_s": timeout, "in_flight": self._live_work()})
                with self._work_cv:
                    streams = list(self._streams)
                log.warning("%s: %d request(s) outlasted the %.1fs grace period; stopping them",
                            reason, len(streams), timeout)
                error = EngineBusy(f"the request was stopped: the engine is {reason} model {model_id!r} "
                                   f"and the {timeout:g}s grace period ran out",
                                   details={"reason": reason})
                for stream in streams:
                    stream._stop(error)
                # a stopped generation ends before its next forward pass
                self._wait_for_work(time.monotonic() + max(timeout, STOP_WAIT_S))
            return self._call(op, timeout_s=max(timeout, STOP_WAIT_S))
        finally:
            with self._work_cv:
                self._draining = self._draining_model = None

    def cancel_all(self, reason: str = "cancel_all") -> int:
        """Stop every running generation; their clients get ``engine_busy``."""
        with self._work_cv:
            streams = list(self._streams)
        error = EngineBusy(f"the request was stopped by the server ({reason})", details={"reason": reason})
        for stream in streams:
            stream._stop(error)
        if streams:
            log.warning("cancel_all stopped %d generation(s): %s", len(streams), reason)
        return len(streams)

    # ------------------------------------------------------------------ model

    def load_model(self, job: LoadModelJob, *, timeout_s: float | None = None) -> EngineStatus:
        """Load ``job``'s model, replacing the resident one once the work running on it
        has finished (bounded by ``timeout_s``: engine_busy after, nothing replaced)."""

        def op() -> EngineStatus:
            from .backends.transformers.runner import TransformersRunner

            self._unload()
            try:
                backend = TransformersRunner(job)
            except Exception as exc:
                if is_out_of_memory(exc):
                    gc.collect()
                    raise InsufficientMemory(f"not enough memory to load {job.model_id}: {exc}") from exc
                raise
            self._backend, self._model_id, self._load_job = backend, job.model_id, job
            if self._scheduler is not None:
                from .backends.transformers.batched import BatchedRunner

                self._scheduler.set_backend(BatchedRunner(backend, self._hooks, max_rows=self.batching.max_batch_size))
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
        backend.close()
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
        from .sae import read_sae_metadata

        backend = self._require_backend()
        cfg = read_sae_metadata(path, layout)
        return check_compatibility(
            cfg, hidden_size=backend.hidden_size, num_layers=backend.num_layers, layer=layer, model_name=self._model_id
        )

    def _prepare_attachment(self, spec: AttachSpec) -> tuple[Attachment, list[str]]:
        backend = self._require_backend()
        if spec.layout is None:
            layout, found = detect_layout(spec.path)
        else:
            layout = get_layout(spec.layout)
            found = layout.detect(Path(spec.path))
            if found is None:
                from .errors import SAEFormatError

                raise SAEFormatError(f"{spec.path} is not a {spec.layout} SAE", details={"path": spec.path})
        cfg = layout.read_metadata(found)
        report = check_compatibility(
            cfg, hidden_size=backend.hidden_size, num_layers=backend.num_layers, layer=spec.layer, model_name=self._model_id
        )
        report.raise_for_errors(spec.sae_id)
        module, path = backend.block(spec.layer)
        try:
            sae = SAE(cfg, layout.load_tensors(cfg), device=backend.device)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise InsufficientMemory(f"not enough memory for SAE {spec.sae_id!r}: {exc}") from exc
            raise
        return Attachment(spec.sae_id, spec.layer, path, sae, module), list(report.warnings)

    def attach_set(self, specs: Sequence[AttachSpec], *, timeout_s: float | None = None) -> list[AttachResult]:
        """Attach several SAEs all-or-nothing (an existing (sae_id, layer) is replaced)."""
        specs = list(specs)
        keys = [(s.sae_id, s.layer) for s in specs]
        if len(set(keys)) != len(keys):
            raise InvalidParameter("the set names one (sae_id, layer) twice", param="attachments")

        def op() -> list[AttachResult]:
            prepared = [self._prepare_attachment(s) for s in specs]  # loads everything first
            installed: list[AttachmentKey] = []
            replaced: dict[AttachmentKey, Attachment] = {}
            try:
                for att, _ in prepared:
                    with self._state_lock:
                        old = self._attachments.pop(att.key, None)
                    if old is not None:
                        self._hooks.remove(att.key)
                        replaced[att.key] = old
                    self._hooks.install(att.key, att.module, att.stats)
                    with self._state_lock:
                        self._attachments[att.key] = att
                    installed.append(att.key)
            except BaseException:
                for key in installed:
                    self._hooks.remove(key)
                    with self._state_lock:
                        self._attachments.pop(key, None)
                for key, old in replaced.items():
                    self._hooks.install(key, old.module, old.stats)
                    with self._state_lock:
                        self._attachments[key] = old
                raise
            results = []
            for att, warnings in prepared:
                cfg = att.sae.cfg
                results.append(
                    AttachResult(att.sae_id, att.layer, att.layer_module_path, cfg.d_in, cfg.d_sae,
                                 cfg.activation, cfg.layout, warnings)
                )
                self._emit("sae:attached", sae_id=att.sae_id, layer=att.layer, layer_module_path=att.layer_module_path)
            return results

        return self._call(op, timeout_s=timeout_s)

    def attach(self, spec: AttachSpec, *, timeout_s: float | None = None) -> AttachResult:
        return self.attach_set([spec], timeout_s=timeout_s)[0]

    def _detach_keys(self, keys: list[AttachmentKey], *, reason: str) -> list[AttachmentKey]:
        for key in keys:
            self._hooks.remove(key)
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

    def _validate_ids(self, ids: Sequence[int], param: str) -> list[int]:
        vocab = self._backend.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidParameter(f"token id {t!r} is outside the vocabulary (0..{vocab - 1})", param=param,
                                       details={"token_id": t, "vocab_size": vocab})
        return list(ids)

    def _prompt_ids(self, job: GenerationJob) -> list[int]:
        backend = self._backend
        if job.prompt_token_ids is not None:
            ids = self._validate_ids(job.prompt_token_ids, "prompt")
        elif job.messages is not None:
            ids = backend.encode_messages(job.messages, add_generation_prompt=job.add_generation_prompt, **job.chat_template_kwargs)
        else:
            ids = backend.encode_text(job.prompt or "", add_special_tokens=job.add_special_tokens)
        if not ids:
            raise InvalidParameter("the prompt is empty after tokenisation", param="prompt")
        return ids

    def _max_tokens(self, job: GenerationJob, n_prompt: int) -> int:
        window = self._backend.context_length
        asked = job.sampling.max_tokens
        max_tokens = asked if asked is not None else max(window - n_prompt, 0)
        if n_prompt + max(max_tokens, 1) > window:
            raise ContextLengthExceeded(prompt_tokens=n_prompt, max_tokens=max_tokens, context_length=window)
        return max_tokens

    def _request_hooks(self, job: GenerationJob, n_prompt: int) -> RequestHooks | None:
        plans: dict[AttachmentKey, AttachmentPlan] = {}

        def attachment(key: AttachmentKey) -> Attachment:
            att = self._attachments.get(key)
            if att is None:
                raise SAENotAttached(f"SAE {key[0]!r} is not attached at layer {key[1]}",
                                     details={"sae_id": key[0], "layer": key[1]})
            return att

        backend = self._backend
        for entry in job.steering.entries if job.steering else []:
            if not entry.features:
                continue
            att = attachment(entry.key)
            att.sae.check_indices(entry.sae_id, entry.features)
            plan = plans.setdefault(entry.key, AttachmentPlan(entry.key))
            plan.delta = att.sae.steering_delta(entry.features, dtype=backend.dtype, device=backend.device)
        for mon in job.monitor.entries if job.monitor else []:
            att = attachment(mon.key)
            att.sae.check_indices(mon.sae_id, mon.features)
            plan = plans.setdefault(mon.key, AttachmentPlan(mon.key))
            mp = MonitorPlan(mon, att.sae, prompt_len=n_prompt)
            (plan.pre if mon.read_point == "pre_steering" else plan.post).append(mp)
        return RequestHooks(job.request_id, plans) if plans else None

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
        with self._state_lock:
            self._in_flight += 1
        try:
            if stream.cancelled:
                stream._put(FinishEvent(job.request_id, "cancelled", "", [], Usage()))
                return
            backend = self._require_backend()
            prompt_ids = self._prompt_ids(job)
            max_tokens = self._max_tokens(job, len(prompt_ids))
            hooks = self._request_hooks(job, len(prompt_ids))
            finish = backend.generate(
                request_id=job.request_id, prompt_ids=prompt_ids, sampling=job.sampling, max_tokens=max_tokens,
                hook_manager=self._hooks, request_hooks=hooks, should_stop=stream._cancel.is_set, emit=stream._put,
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
        from .backends.transformers.sequence import Sequence

        backend = self._require_backend()
        prompt_ids = self._prompt_ids(job)
        max_tokens = self._max_tokens(job, len(prompt_ids))
        hooks = self._request_hooks(job, len(prompt_ids))
        return Sequence(backend, request_id=job.request_id, prompt_ids=prompt_ids, sampling=job.sampling,
                        max_tokens=max_tokens, request_hooks=hooks, emit=stream._put, should_stop=stream._cancel.is_set)

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
        stream = GenerationStream(job.request_id, on_end=self._work_ended)
        refused = self._admit_work(stream)
        if refused is not None:
            stream._put(ErrorEvent(job.request_id, refused.code, refused.message, refused.details))
            return stream

        def dropped() -> None:
            err = EngineShutdown("the engine shut down before the request ran")
            stream._put(ErrorEvent(job.request_id, err.code, err.message, {}))

        if self._scheduler is not None:
            self._submit(lambda: self._enqueue(job, stream), _WORK, on_drop=dropped)
        else:
            self._submit(lambda: self._run_generation(job, stream), _WORK, on_drop=dropped)
        return stream

    def generate_sync(self, job: GenerationJob, *, timeout_s: float | None = None) -> GenerationResult:
        return self.generate(job).result(timeout_s)

    def _work(self, fn: Callable[[], Any], timeout_s: float | None) -> Any:
        refused = self._admit_work()
        if refused is not None:
            raise refused
        try:
            task = self._submit(fn, _WORK)
            try:
                return task.future.result(timeout=timeout_s)
            except FutureTimeout:
                task.future.cancel()
                raise EngineBusy("timed out waiting for the engine", details={"timeout_s": timeout_s}) from None
        finally:
            self._work_ended()

    def _inputs(self, items: Sequence[Any], param: str, add_special_tokens: bool = True) -> list[list[int]]:
        out = []
        for item in items:
            if isinstance(item, str):
                ids = self._backend.encode_text(item, add_special_tokens=add_special_tokens)
            elif isinstance(item, (list, tuple)):
                ids = self._validate_ids(list(item), param)
            else:
                raise InvalidParameter("each input must be a string or a list of token ids", param=param)
            if not ids:
                raise InvalidParameter("an input is empty", param=param)
            if len(ids) > self._backend.context_length:
                raise ContextLengthExceeded(prompt_tokens=len(ids), max_tokens=0, context_length=self._backend.context_length)
            out.append(ids)
        return out

    def embed(self, job: EmbedJob, *, timeout_s: float | None = None) -> EmbedResult:
        def op() -> EmbedResult:
            backend = self._require_backend()
            inputs = self._inputs(job.inputs, "input")
            with self._hooks.suppressed():
                return backend.embed(job, inputs)

        return self._work(op, timeout_s)

    def score(self, job: ScoreJob, *, timeout_s: float | None = None) -> ScoreResult:
        def op() -> ScoreResult:
            backend = self._require_backend()
            if job.prompt_token_ids is not None:
                ids = self._inputs([list(job.prompt_token_ids)], "prompt")[0]
            else:
                ids = self._inputs([job.prompt], "prompt", job.add_special_tokens)[0]
            if job.allowed_token_ids is not None:
                self._validate_ids(job.allowed_token_ids, "allowed_token_ids")
            with self._hooks.suppressed():
                return backend.score(job, ids)

        return self._work(op, timeout_s)

    # ------------------------------------------------------------------ status

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait (bounded) until the generation in flight finishes; False on timeout."""
        try:
            self._call(lambda: None, timeout_s=timeout_s)
            return True
        except EngineBusy:
            return False

    def batching_status(self) -> dict[str, Any]:
        """The generation backend's mode and what it can do per request (for health)."""
        sched = self._scheduler
        caps = {
            "per_request_sampling": True,
            "per_request_seeds": True,
            "stop_sequences": True,
            "cancellation": True,
            "per_request_steering": True,
            "per_request_monitoring": True,
            "exact_monitoring_attribution": True,
            "logprobs": True,
            "prompt_logprobs": True,
            "shared_forward_passes": sched is not None,
            "serial_fallback": False,
        }
        data: dict[str, Any] = {
            "enabled": sched is not None,
            "mode": "continuous_batching" if sched is not None else "serial",
            "capabilities": caps,
        }
        if sched is not None:
            data.update(sched.status())
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
                                batching=self.batching_status(), draining=self._draining)
        return EngineStatus(
            state="ready", draining=self._draining, backend=b.name, model_id=self._model_id, model_path=str(self._load_job.path) if self._load_job else None,
            dtype=self._load_job.dtype if self._load_job else None, device=str(b.device), context_length=b.context_length,
            num_layers=b.num_layers, hidden_size=b.hidden_size, vocab_size=b.vocab_size,
            attachments=self.attachments(), in_flight=self._in_flight_total(), queued=max(self._queued, 0),
            batching=self.batching_status(), kernels=getattr(b, "kernels", None),
        )

    @property
    def hook_manager(self) -> HookManager:
        return self._hooks

    @property
    def backend(self) -> Any:
        return self._backend


# every command of the protocol table is an Engine method with the declared arguments
check_implements(Engine)

__all__ = ["Attachment", "Engine", "GenerationStream", "is_out_of_memory"]
