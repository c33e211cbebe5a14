"""Continuous-batching policy: who joins the batch, who leaves it, and when.

The scheduler owns the requests waiting for a row and the sequences running in the
batch; a backend's batched runner owns the forward passes (``start`` = the admitted
requests' prefill and first tokens, ``step`` = one decode step for every row, ``remove``).  It runs
on the engine's worker thread, one ``step`` at a time between the engine's other tasks,
so nothing here needs a lock and an idle scheduler costs nothing (no thread of its own).

One ``step``:

1. requests whose caller cancelled leave: waiting ones end ``cancelled`` with no token,
   running ones end ``cancelled`` with the tokens they have (within one decode step);
2. admission (unless draining for attach/detach/load): waiting requests start in
   arrival order while a row is free and the iteration's prefill budget lasts (the first
   always starts); a request that must run alone (``force_serial_monitoring``) waits for
   an empty batch and then holds it to itself. Interactive requests come first: batch
   work (``GenerationJob.priority == "batch"``, Batch API lines) waits in its own queue
   and starts only in an iteration where no interactive request waits or starts (so an
   interactive prefill never shares its step with batch prefills), only into the rows
   batch work may hold (``BatchingOptions.batch_rows`` beyond ``max_batch_size``);
3. one decode step for every running row; finished rows leave at once, so their slot is
   free for the next iteration's admissions.

The events of admission (first tokens, refusals) and of the decode step are each handed
to their consumers in one burst when that phase ends (``stream.held_deliveries``).  A
finished request with a capture is drained to the host in its phase, and its final event
goes, after that burst, to the engine's capture writer, which packs the artifact on its
own thread and then delivers the event (``capture_writer``): the batch never waits for a
capture's file.

Failures: a request whose prefill fails ends with that error and the batch goes on; a
failed decode step ends every running request with the error (the batch's state is
unknown) and starts a fresh cache.  ``classify`` turns an exception into the engine
error to report (and runs the engine's out-of-memory recovery).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..backends.base import BatchBackend, CountsLeanSteps, ReportsKV
from ..api.errors import EngineBusy, EngineError, ModelNotLoaded
from ..api.protocol import BatchingOptions, ErrorEvent, FinishEvent, GenerationJob, Usage
from ..api.results import TokenEvent
from .capture_writer import CaptureWriter, deliver
from .stream import held_deliveries

log = logging.getLogger("gpu_engine.scheduler")  # the name operators' log filters know

# tokens_per_second: the tokens of the steps that ended in the last this many seconds
RATE_WINDOW_S = 10.0


def _tokens(seqs: list[Any]) -> int:
    return sum(len(s.generated) for s in seqs)


class StepFigures:
    """What the batch's forward passes cost (status: engine metrics). Written by the
    worker thread at each step's end, read by status on any thread: plain numbers and a
    deque, for which a racy read is a figure a step old."""

    def __init__(self) -> None:
        self.decode_steps = 0
        self.decode_seconds = 0.0
        self.last_step_seconds: float | None = None
        self.prefills = 0
        self.prefill_seconds = 0.0
        self.generated_tokens = 0
        # a step's (or, serial, a token's) end: 16384 hold RATE_WINDOW_S at 1600 a second
        self._recent: deque[tuple[float, int]] = deque(maxlen=16384)

    def decoded(self, seconds: float, tokens: int) -> None:
        self.decode_steps += 1
        self.decode_seconds += seconds
        self.last_step_seconds = seconds
        self._counted(tokens)

    def prefilled(self, seconds: float, tokens: int) -> None:
        self.prefills += 1
        self.prefill_seconds += seconds
        self._counted(tokens)

    def timed(self, emit: Callable[[Any], None]) -> Callable[[Any], None]:
        """``emit`` for one serial generation, timing it: its first token ends the prefill,
        each later one a decode step (the time since the token before)."""
        last = [time.perf_counter()]
        seen = [False]

        def timed_emit(event: Any) -> None:
            if isinstance(event, TokenEvent):
                now = time.perf_counter()
                if seen[0]:
                    self.decoded(now - last[0], 1)
                else:
                    self.prefilled(now - last[0], 1)
                    seen[0] = True
                last[0] = now
            emit(event)

        return timed_emit

    def _counted(self, tokens: int) -> None:
        self.generated_tokens += tokens
        self._recent.append((time.monotonic(), tokens))

    def tokens_per_second(self) -> float:
        since = time.monotonic() - RATE_WINDOW_S
        return round(sum(n for at, n in list(self._recent) if at >= since) / RATE_WINDOW_S, 3)

    def status(self) -> dict[str, Any]:
        steps = self.decode_steps
        return {
            "decode_seconds_total": round(self.decode_seconds, 6),
            "step_seconds_last": None if self.last_step_seconds is None else round(self.last_step_seconds, 6),
            "step_seconds_mean": round(self.decode_seconds / steps, 6) if steps else None,
            "prefills_total": self.prefills,
            "prefill_seconds_total": round(self.prefill_seconds, 6),
            "generated_tokens_total": self.generated_tokens,
            "tokens_per_second": self.tokens_per_second(),
        }


class _Stream(Protocol):
    request_id: str

    @property
    def cancelled(self) -> bool: ...

    def _put(self, event: Any) -> None: ...


class BatchScheduler:
    def __init__(
        self,
        options: BatchingOptions,
        *,
        make_sequence: Callable[[GenerationJob, Any], Any],
        classify: Callable[[BaseException], EngineError],
        writer: CaptureWriter | None = None,
        figures: StepFigures | None = None,
    ) -> None:
        self.options = options
        self.make_sequence = make_sequence
        self.classify = classify
        # packs finished captures off this thread; None: packed here, at the request's end
        self.writer = writer
        # (capture plan, final event, emit) of this phase's finished captures, for the writer
        self._packing: list[tuple[Any, FinishEvent, Callable[[Any], None]]] = []
        self.backend: BatchBackend | None = None
        self.waiting: deque[tuple[GenerationJob, _Stream]] = deque()
        self.waiting_batch: deque[tuple[GenerationJob, _Stream]] = deque()
        self.running: list[Any] = []
        self._exclusive = False
        self.admitted_total = 0
        self.refused_total = 0
        # the engine's (it outlives a batch-only backend's scheduler), or this one's own
        self.figures = figures if figures is not None else StepFigures()

    # ------------------------------------------------------------------ state

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.waiting_batch or self.running)

    def set_backend(self, backend: BatchBackend | None) -> None:
        """A new model (or none); only called with nothing running (control ops drain)."""
        self.backend = backend
        self.running = []
        self._exclusive = False

    def enqueue(self, job: GenerationJob, stream: _Stream) -> None:
        """Accept a request for the batch, or refuse it at once (never wait).

        Capacity is the free rows plus ``max_queue_size`` places: a burst that arrives
        before the next step still fills the free rows rather than counting as queued.
        """
        batch = job.priority == "batch"
        queue = self.waiting_batch if batch else self.waiting
        free_rows = max(self._row_limit(batch) - self._running_of(batch), 0)
        if len(queue) >= self.options.max_queue_size + free_rows:
            self.refused_total += 1
            raise EngineBusy(
                f"the batch queue is full ({self.options.max_queue_size} requests waiting)",
                details={"reason": "batch_queue_full", "max_queue_size": self.options.max_queue_size},
            )
        queue.append((job, stream))

    def _row_limit(self, batch: bool) -> int:
        o = self.options
        if batch:
            return o.batch_rows or o.max_batch_size
        return o.max_batch_size

    def _running_of(self, batch: bool) -> int:
        return sum(1 for s in self.running if getattr(s, "batch", False) == batch)

    def _must_run_alone(self, job: GenerationJob) -> bool:
        return self.options.force_serial_monitoring and job.monitor is not None and bool(job.monitor.entries)

    # ------------------------------------------------------------------ step

    def step(self, *, admit: bool = True) -> None:
        try:
            self._reap_cancelled()
            self._to_writer()
            # each phase's events (a row's first token from its prefill, then one token per
            # running row) reach their consumers in one burst as soon as that phase is done:
            # a prefill's first tokens do not wait for the decode step after it
            if admit:
                with held_deliveries():
                    self._admit()
                self._to_writer()
            if self.running:
                with held_deliveries():
                    self._decode()
        finally:
            # after the burst: a request's tokens are all delivered before its final event
            self._to_writer()

    def _finish(self, seq: Any) -> None:
        """End a sequence: its final event now, or its capture's artifact (drained to the
        host here) and final event kept for the writer until the phase's burst is out."""
        if self.writer is None or seq.capture is None:
            seq.emit(seq.finish())
            return
        seq.capture.deferred = True
        event = seq.finish()
        self._packing.append((seq.capture, event, seq.emit))

    def _to_writer(self) -> None:
        packing, self._packing = self._packing, []
        for capture, event, emit in packing:
            deliver(self.writer, capture, event, emit)  # type: ignore[arg-type]

    def _reap_cancelled(self) -> None:
        self.waiting = self._reap_waiting(self.waiting)
        self.waiting_batch = self._reap_waiting(self.waiting_batch)
        for seq in [s for s in self.running if s.should_stop()]:
            seq.cancel()
            self._retire(seq)

    @staticmethod
    def _reap_waiting(waiting: deque[tuple[GenerationJob, _Stream]]) -> deque[tuple[GenerationJob, _Stream]]:
        if not waiting or not any(stream.cancelled for _, stream in waiting):
            return waiting
        keep: deque[tuple[GenerationJob, _Stream]] = deque()
        for job, stream in waiting:
            if stream.cancelled:
                stream._put(FinishEvent(job.request_id, "cancelled", "", [], Usage()))
            else:
                keep.append((job, stream))
        return keep

    def _admit(self) -> None:
        admitted: list[Any] = []
        budget = self._admit_from(self.waiting, False, admitted, self.options.prefill_budget_tokens)
        if not admitted and not self.waiting:
            # batch work only fills rows no interactive request waits for, and never joins
            # an interactive request's prefill step (its time to first token)
            self._admit_from(self.waiting_batch, True, admitted, budget)
        if not admitted:
            return
        self._start(admitted)

    def _admit_from(
        self, waiting: deque[tuple[GenerationJob, _Stream]], batch: bool, admitted: list[Any], budget: int
    ) -> int:
        o = self.options
        total_rows = o.max_batch_size + o.batch_rows
        limit = self._row_limit(batch)
        running_here = self._running_of(batch)
        while (
            waiting
            and len(self.running) + len(admitted) < total_rows
            and running_here < limit
            and (budget > 0 or not admitted)
        ):
            if self._exclusive:
                break
            job, stream = waiting[0]
            alone = self._must_run_alone(job)
            if alone and (self.running or admitted):
                break  # head of line waits for the batch to empty
            waiting.popleft()
            try:
                if self.backend is None:
                    raise ModelNotLoaded("no model is loaded")
                seq = self.make_sequence(job, stream)
            except Exception as exc:  # noqa: BLE001 - refusals (bad prompt, unknown SAE) end this request only
                err = self._error(exc, job.request_id)
                stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
                continue
            seq.exclusive = alone
            seq.batch = batch
            admitted.append(seq)
            running_here += 1
            budget -= seq.n_prompt
            self.admitted_total += 1
            if alone:
                self._exclusive = True
                break
        return budget

    def _start(self, admitted: list[Any]) -> None:
        began = time.perf_counter()
        try:
            finished = self.backend.start(admitted)  # type: ignore[union-attr]
            self.figures.prefilled(time.perf_counter() - began, _tokens(admitted))
        except Exception as exc:  # noqa: BLE001 - reported on the requests' streams
            err = self._error(exc, admitted[0].request_id)
            for seq in admitted:
                seq.emit(ErrorEvent(seq.request_id, err.code, err.message, err.details))
            if err.code == "insufficient_memory" or any(s in self.backend.rows for s in admitted):  # type: ignore[union-attr]
                # memory is short (SAEs were detached) or the batch state is unknown
                self._fail_running(err)
            self._exclusive = any(s.exclusive for s in self.running)
            return
        for seq in admitted:
            if seq in finished:
                if seq.exclusive:
                    self._exclusive = False
                self._finish(seq)
            else:
                self.running.append(seq)

    def _decode(self) -> None:
        rows = list(self.running)
        before = _tokens(rows)
        began = time.perf_counter()
        try:
            finished = self.backend.step()  # type: ignore[union-attr]
            self.figures.decoded(time.perf_counter() - began, _tokens(rows) - before)
        except Exception as exc:  # noqa: BLE001 - every running request gets the error
            self._fail_running(self._error(exc, None))
            return
        for seq in finished:
            self._retire(seq)

    def _retire(self, seq: Any) -> None:
        self.backend.remove(seq)  # type: ignore[union-attr]
        self.running.remove(seq)
        if seq.exclusive:
            self._exclusive = False
        self._finish(seq)

    def _error(self, exc: BaseException, request_id: str | None) -> EngineError:
        if not isinstance(exc, EngineError):
            log.exception("batched generation failed (request %s)", request_id or "<batch step>", exc_info=exc)
        return exc if isinstance(exc, EngineError) else self.classify(exc)

    def _fail_running(self, err: EngineError) -> None:
        for seq in self.running:
            seq.emit(ErrorEvent(seq.request_id, err.code, err.message, err.details))
        self.running = []
        self._exclusive = False
        if self.backend is not None:
            self.backend.reset()

    def abort_all(self, err: EngineError) -> None:
        """End everything (engine shutdown)."""
        for job, stream in [*self.waiting, *self.waiting_batch]:
            stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
        self.waiting.clear()
        self.waiting_batch.clear()
        self._fail_running(err)
        self._to_writer()

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        o = self.options
        backend = self.backend
        running = len(self.running)
        rows = o.max_batch_size + o.batch_rows
        return {
            # engine metrics (docs/operators.md, "Metrics"): the rows held of the rows there are
            "occupancy": round(running / rows, 6) if rows else 0.0,
            "max_rows": rows,
            "queue_depth": len(self.waiting) + len(self.waiting_batch),
            "kv": kv_usage(backend, list(self.running)),
            **self.figures.status(),
            "running": running,
            "waiting": len(self.waiting),
            "running_batch": self._running_of(True),
            "waiting_batch": len(self.waiting_batch),
            "batch_rows": o.batch_rows,
            "decode_steps": backend.steps if backend is not None else 0,
            # of which ran without model.forward (the transformers backend's lean step)
            "lean_decode_steps": backend.lean_steps if isinstance(backend, CountsLeanSteps) else 0,
            "admitted_total": self.admitted_total,
            "refused_total": self.refused_total,
            "max_batch_size": o.max_batch_size,
            "max_queue_size": o.max_queue_size,
            "prefill_budget_tokens": o.prefill_budget_tokens,
            "force_serial_monitoring": o.force_serial_monitoring,
        }


def kv_usage(runner: BatchBackend | None, running: list[Any]) -> dict[str, Any] | None:
    """The KV cache as the batch runner can tell it (``ReportsKV``): bytes the running
    rows hold and, where known, what is reserved; None where the runner cannot say."""
    if not isinstance(runner, ReportsKV):
        return None
    try:
        return runner.kv_usage(running)
    except Exception:  # noqa: BLE001 - a figure for status; never breaks the heartbeat
        log.warning("kv usage unavailable", exc_info=True)
        return None


__all__ = ["BatchBackend", "BatchScheduler"]
