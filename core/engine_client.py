"""The one interface through which the web tier reaches the engine.

``EngineClient`` has one method per command of ``gpu_engine.api.commands.COMMANDS`` (checked
at import: a command of the table without its method here fails at once), each of which
builds the command's argument struct and hands it to the transport's ``invoke``. A
transport implements ``invoke`` only, so it carries every command or none: the embedded
one below runs ``command.call`` on a ``gpu_engine.runtime.engine.Engine`` in this process (a
worker thread); the distributed one (``core.engine_client_redis``: Redis Streams to
``run_engine``) sends the command by name and decodes its declared result type. Views,
services and tasks reach it as ``core.runtime.runtime().engine`` and never import the
engine itself, so the web tier stays free of torch in distributed mode.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import structlog
from django.conf import settings

from core.engine_options import batching_options, idle_release_s
from core.runtime import runtime
from gpu_engine.api.commands import (
    COMMANDS,
    AttachSetArgs,
    AttributionArgs,
    BuildGrammarArgs,
    CancelAllArgs,
    CheckLoadArgs,
    CheckSaeArgs,
    Command,
    DetachArgs,
    EmbedArgs,
    FeatureLogitsArgs,
    GenerateArgs,
    HiddenStatesArgs,
    Lane,
    LoadModelArgs,
    ScoreArgs,
    StatusArgs,
    TokenizeArgs,
    UnloadModelArgs,
    check_implements,
)
from gpu_engine.api.errors import EngineBusy
from gpu_engine.api.host import host_memory
from gpu_engine.api.protocol import (
    AttachmentKey,
    AttachmentStatus,
    AttachResult,
    AttachSpec,
    AttributionJob,
    AttributionResult,
    EmbedJob,
    EmbedResult,
    EngineEvent,
    EngineStatus,
    ErrorEvent,
    FeatureLogitsJob,
    FeatureLogitsResult,
    FinishEvent,
    GenerationEvent,
    GenerationJob,
    HiddenStatesJob,
    HiddenStatesResult,
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    StructuredOutput,
    TokenizeJob,
    TokenizeResult,
)
from gpu_engine.api.sae import CompatibilityReport

log = structlog.get_logger(__name__)

# The announcement (``Engine.arriving``) of the generation request this task serves, set by
# ``announced`` and released by the first submission of one of its jobs (``agenerate``).
_ARRIVAL: contextvars.ContextVar[Any] = contextvars.ContextVar("millm_arrival", default=None)


class _NoArrival:
    def release(self) -> None:
        pass


@contextmanager
def announced(client: EngineClient) -> Iterator[None]:
    """Serve one generation request announced to the engine: from here until its first job
    is submitted (or the request ends without one), an idle batching engine about to start
    the requests already queued waits for it (``BatchingOptions.gather_ms``), so a burst
    of requests is prefilled in one pass.  The announcement travels with the request's
    context (tasks and ``sync_to_async`` threads copy it)."""
    arrival = client.arriving()
    token = _ARRIVAL.set(arrival)
    try:
        yield
    finally:
        arrival.release()
        _ARRIVAL.reset(token)


def arrived() -> None:
    """The announced request has handed its work to the engine (a generation submitted,
    or work that is not a generation, such as a score): the engine need not wait for it."""
    arrival = _ARRIVAL.get()
    if arrival is not None:
        arrival.release()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# Generous: a pump thread lives as long as its stream, and pumps are cheap (they block on
# the engine's queue). Reused threads matter: starting a thread blocks the event loop
# until the thread runs, which costs milliseconds of time-to-first-token on a busy host.
STREAM_PUMP_THREADS = 256
# Bounds a pump's wait for the next event (a stuck engine must not pin the thread, nor
# keep the process from exiting); far above any one forward pass.
STREAM_EVENT_TIMEOUT_S = 600.0


def _stream_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=STREAM_PUMP_THREADS, thread_name_prefix="millm-stream")
        return _pool


class GenerationHandle(ABC):
    """A running generation: iterate its events, or cancel it."""

    request_id: str

    @abstractmethod
    def events(self, timeout_s: float | None = None) -> Iterator[GenerationEvent]: ...

    @abstractmethod
    def cancel(self) -> None: ...


class EngineClient(ABC):
    @property
    def backend_name(self) -> str:
        """The loaded model's backend ("none" while no model is loaded)."""
        return self.status().backend or "none"

    # whether ``status()`` waits on I/O (a Redis read) and so must leave the event loop
    status_blocks: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a transport that answered a command itself could drift from the table
        overridden = sorted(name for name in COMMANDS if name in vars(cls))
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} overrides {overridden}: a transport "
                "implements invoke() only, so every command goes through "
                "gpu_engine.api.commands"
            )

    @abstractmethod
    def invoke(self, command: Command, args: Any) -> Any:
        """Run one command of the table with its argument struct; the declared result
        (a ``GenerationHandle`` for the ``stream`` command)."""

    # one method per command of gpu_engine.api.commands, in the table's order

    def status(self) -> EngineStatus:
        return self.invoke(COMMANDS["status"], StatusArgs())

    def check_load(self, job: LoadModelJob) -> None:
        self.invoke(COMMANDS["check_load"], CheckLoadArgs(job))

    def build_grammar(self, spec: StructuredOutput) -> None:
        self.invoke(COMMANDS["build_grammar"], BuildGrammarArgs(spec))

    def load_model(self, job: LoadModelJob, *, timeout_s: float | None = None) -> EngineStatus:
        return self.invoke(COMMANDS["load_model"], LoadModelArgs(job, timeout_s))

    def unload_model(self, *, timeout_s: float | None = None) -> None:
        self.invoke(COMMANDS["unload_model"], UnloadModelArgs(timeout_s))

    def attach_set(self, specs: Sequence[AttachSpec], *, timeout_s: float | None = None) -> list[AttachResult]:
        return self.invoke(COMMANDS["attach_set"], AttachSetArgs(list(specs), timeout_s))

    def detach(
        self, sae_id: str | None = None, layer: int | None = None, *, timeout_s: float | None = None
    ) -> list[AttachmentKey]:
        return self.invoke(COMMANDS["detach"], DetachArgs(sae_id, layer, timeout_s))

    def check_sae(self, path: str, layer: int, *, layout: str | None = None) -> CompatibilityReport:
        return self.invoke(COMMANDS["check_sae"], CheckSaeArgs(path, layer, layout))

    def cancel_all(self, *, reason: str = "cancel_all") -> int:
        """Stop every queued and running generation (each ends with engine_busy)."""
        return self.invoke(COMMANDS["cancel_all"], CancelAllArgs(reason))

    def generate(self, job: GenerationJob) -> GenerationHandle:
        return self.invoke(COMMANDS["generate"], GenerateArgs(job))

    def embed(self, job: EmbedJob, *, timeout_s: float | None = None) -> EmbedResult:
        return self.invoke(COMMANDS["embed"], EmbedArgs(job, timeout_s))

    def score(self, job: ScoreJob, *, timeout_s: float | None = None) -> ScoreResult:
        return self.invoke(COMMANDS["score"], ScoreArgs(job, timeout_s))

    def hidden_states(self, job: HiddenStatesJob, *, timeout_s: float | None = None) -> HiddenStatesResult:
        return self.invoke(COMMANDS["hidden_states"], HiddenStatesArgs(job, timeout_s))

    def tokenize(self, job: TokenizeJob, *, timeout_s: float | None = None) -> TokenizeResult:
        return self.invoke(COMMANDS["tokenize"], TokenizeArgs(job, timeout_s))

    def feature_logits(self, job: FeatureLogitsJob, *, timeout_s: float | None = None) -> FeatureLogitsResult:
        return self.invoke(COMMANDS["feature_logits"], FeatureLogitsArgs(job, timeout_s))

    def attribution(self, job: AttributionJob, *, timeout_s: float | None = None) -> AttributionResult:
        return self.invoke(COMMANDS["attribution"], AttributionArgs(job, timeout_s))

    def attachments(self) -> list[AttachmentStatus]:
        return list(self.status().attachments)

    def shutdown(self) -> None:  # noqa: B027 - optional: most clients hold nothing to release
        """Release the engine (tests, process exit)."""

    def resolve_device_and_dtype(self, device: str, dtype: str) -> tuple[str, str]:
        """What ``auto`` means where this client's engine runs (here: this process)."""
        return _resolve_here(device, dtype)

    def free_memory(self, device: str) -> int | None:
        """Free bytes on ``device`` of the engine's host (a CUDA card, or ``cpu``: the
        host's available memory); None when unknown."""
        if device == "cpu":
            mem = host_memory()
            return mem["free"] if mem is not None else None
        if not device.startswith("cuda"):
            return None
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)
        return int(free)

    def arriving(self) -> Any:
        """Announce a generation request on its way (``announced``); an object with
        ``release()``.  This default announces nothing: an engine in another process
        starts its batches as requests reach it."""
        return _NoArrival()

    async def agenerate(self, job: GenerationJob) -> AsyncIterator[GenerationEvent]:
        """Async view of ``generate``: events arrive on the caller's loop without blocking
        it; leaving the iteration early (a client that disconnected) cancels the
        generation, which stops before its next forward pass."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = threading.Event()
        holder: list[GenerationHandle] = []

        def pump() -> None:
            # submitting and reading both happen on this thread: one hop per request
            try:
                handle = self.generate(job)
                holder.append(handle)
                if done.is_set():  # the consumer left while we were submitting
                    handle.cancel()
                for event in handle.events(STREAM_EVENT_TIMEOUT_S):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
                    if done.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        _stream_pool().submit(pump)
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, (FinishEvent, ErrorEvent)):
                    return
        finally:
            done.set()
            for handle in holder:
                handle.cancel()


class _EmbeddedHandle(GenerationHandle):
    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.request_id = stream.request_id

    @property
    def stream(self) -> Any:
        return self._stream

    def events(self, timeout_s: float | None = None) -> Iterator[GenerationEvent]:
        return self._stream.events(timeout_s)

    def cancel(self) -> None:
        self._stream.cancel()


class _LoopInbox:
    """Events from the engine's thread for the streams of one event loop, handed over with
    one wake-up of the loop per burst.  A batch step makes an event for every running row
    and hands them over together (``gpu_engine.runtime.stream.held_deliveries``); waking the loop
    once per event (a write to its self-pipe, a pass of its selector, the GIL taken back
    and forth) cost a 16-row step on 2 cores about a millisecond, taken from the forward
    passes (docs/performance.md, "The vLLM backend against plain vLLM")."""

    _inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox] = weakref.WeakKeyDictionary()
    _inboxes_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, GenerationEvent]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopInbox:
        with cls._inboxes_lock:
            inbox = cls._inboxes.get(loop)
            if inbox is None:
                inbox = cls._inboxes[loop] = cls(loop)
            return inbox

    def put(self, queue: asyncio.Queue, event: GenerationEvent) -> bool:
        """Leave ``event`` for ``queue`` (any thread) until the next ``wake``; False when
        the loop is closed (nobody will read it)."""
        if self.loop.is_closed():
            return False
        with self._lock:
            self._items.append((queue, event))
        return True

    def wake(self) -> None:
        """Have the loop hand what was put to its queues (one wake-up, however many)."""
        with self._lock:
            if self._scheduled or not self._items:
                return  # the wake-up already asked for takes these too
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed: its streams were cancelled by ``put``
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, event in items:
            queue.put_nowait(event)


class EmbeddedEngineClient(EngineClient):
    """The engine in this process, on its own worker thread (embedded mode)."""

    def __init__(
        self, *, on_event: Callable[[EngineEvent], None] | None = None, drain_timeout_s: float | None = None
    ) -> None:
        from gpu_engine.runtime.engine import Engine

        self._engine = Engine(
            on_event=on_event,
            drain_timeout_s=drain_timeout_s or settings.GRACEFUL_UNLOAD_TIMEOUT,
            batching=batching_options(),
            idle_release_s=idle_release_s(),
            structured_timeout_s=float(settings.STRUCTURED_COMPILE_TIMEOUT_S),
        )

    @property
    def engine(self) -> Any:
        return self._engine

    # the engine's status is read from its memory under a short lock: no I/O
    status_blocks = False

    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self._engine.backend_name or "none"

    def invoke(self, command: Command, args: Any) -> Any:
        result = command.call(self._engine, args)
        return _EmbeddedHandle(result) if command.lane is Lane.STREAM else result

    async def agenerate(self, job: GenerationJob) -> AsyncIterator[GenerationEvent]:
        """One hop per event (per batch step for a batch's rows: ``_LoopInbox``) and none
        before the first forward pass: submitting only queues the job on the engine's
        thread, and the engine hands each event to this loop as it produces it (no pump
        thread waiting on the stream)."""
        inbox = _LoopInbox.of(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        handle = self.generate(job)
        arrived()

        def deliver(event: GenerationEvent) -> None:  # on the engine's thread
            if not inbox.put(queue, event):  # the consumer's loop is closed: nobody is left to tell
                handle.cancel()

        handle.stream.deliver_to(deliver, inbox.wake)
        ended = False
        try:
            while True:
                try:
                    async with asyncio.timeout(STREAM_EVENT_TIMEOUT_S):
                        event = await queue.get()
                except TimeoutError:
                    raise EngineBusy(
                        f"no event for request {job.request_id!r} within {STREAM_EVENT_TIMEOUT_S}s"
                    ) from None
                ended = isinstance(event, (FinishEvent, ErrorEvent))
                yield event
                if ended:
                    return
        finally:
            if not ended:
                handle.cancel()

    def arriving(self) -> Any:
        return self._engine.arriving()

    def shutdown(self) -> None:
        self._engine.shutdown()


check_implements(EngineClient, where="core.engine_client.EngineClient")


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """Turn ``auto`` settings into what the engine loads with (bf16 on CUDA, fp32 on CPU).

    In distributed mode ``auto`` is decided on the engine's host (its heartbeat reports
    it), so the web tier never imports torch to answer it."""
    if device != "auto" and dtype != "auto":
        return device, dtype
    if not settings.EMBEDDED:
        return runtime().engine.resolve_device_and_dtype(device, dtype)
    return _resolve_here(device, dtype)


def _resolve_here(device: str, dtype: str) -> tuple[str, str]:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype
