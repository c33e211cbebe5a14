"""One generation's events, as the engine produces them on its worker thread: iterated
by a thread (``events()``), or handed to a callback as they come (``deliver_to``, how an
asyncio consumer takes them without a thread of its own); ``cancel()`` stops the
generation before its next forward pass.

``held_deliveries()`` is how a batch step hands its events over (``scheduler.py``, once
for its admissions and once for its decode step): the events every row made in that phase
reach their callbacks together when the phase is done, in one burst, so that a consumer
which wakes its event loop once per burst (the web tier's, ``core.engine_client``) wakes
it once per phase rather than once per row.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..api.errors import EngineBusy, EngineError
from ..api.protocol import ErrorEvent, FinishEvent, GenerationEvent, GenerationResult

_held = threading.local()


@contextmanager
def held_deliveries() -> Iterator[None]:
    """Inside this block (on this thread), events bound for ``deliver_to`` callbacks are
    kept, in order, and handed over when it ends, however it ends.  Nested blocks hand
    over at the outermost one's end, each callback's events first and then each distinct
    ``wake`` (``deliver_to``) once.  Events of a stream nobody delivers to yet go to its
    queue at once, as outside the block."""
    if getattr(_held, "items", None) is not None:
        yield
        return
    _held.items = []
    try:
        yield
    finally:
        items, _held.items = _held.items, None
        wakes: dict[Callable[[], None], None] = {}
        for deliver, wake, event in items:
            deliver(event)
            if wake is not None:
                wakes[wake] = None
        for wake in wakes:  # every consumer once, after all its events
            wake()


class GenerationStream:
    """Events of one generation, produced on the engine's worker thread.

    Iterate for ``TokenEvent``s ending with one ``FinishEvent`` or ``ErrorEvent``.
    ``cancel()`` (or abandoning the iteration) stops the generation before its next
    forward pass and frees the engine for the next request.
    """

    def __init__(self, request_id: str, on_end: Callable[[GenerationStream], None] | None = None) -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._done = False
        self._ended = False
        self._on_end = on_end
        # set when the engine (not the client) stops the generation: its client gets this
        # error instead of a "cancelled" finish it never asked for
        self._stopped_with: EngineError | None = None
        # ``deliver_to``: events handed to a callback on the engine's thread, not queued
        self._deliver: Callable[[GenerationEvent], None] | None = None
        self._wake: Callable[[], None] | None = None
        self._deliver_lock = threading.Lock()

    def _hand_over(self, event: GenerationEvent) -> None:
        with self._deliver_lock:
            if self._deliver is None:
                self._events.put(event)
                return
            held = getattr(_held, "items", None)
            if held is not None:
                held.append((self._deliver, self._wake, event))
                return
            self._deliver(event)
            if self._wake is not None:
                self._wake()

    def _put(self, event: GenerationEvent) -> None:
        if not isinstance(event, (FinishEvent, ErrorEvent)):
            self._hand_over(event)
            return
        if self._ended:
            return
        self._ended = True
        err = self._stopped_with
        if err is not None and isinstance(event, FinishEvent) and event.finish_reason == "cancelled":
            event = ErrorEvent(self.request_id, err.code, err.message, err.details)
        self._hand_over(event)
        if self._on_end is not None:
            self._on_end(self)

    def deliver_to(self, deliver: Callable[[GenerationEvent], None], wake: Callable[[], None] | None = None) -> None:
        """Hand every event to ``deliver`` as it is produced (on the engine's thread; it
        must not block), those already produced first — instead of ``events()``. With
        ``wake``, ``deliver`` only leaves the event where the consumer will look, and
        ``wake()`` follows each event, or each ``held_deliveries`` burst once: an asyncio
        consumer's ``wake`` schedules its loop (one hop per event, or per batch step for
        all its streams), and no thread of its own waits on the queue."""
        with self._deliver_lock:
            pending = False
            while True:
                try:
                    deliver(self._events.get_nowait())
                    pending = True
                except queue.Empty:
                    break
            if pending and wake is not None:
                wake()
            self._deliver = deliver
            self._wake = wake

    def cancel(self) -> None:
        self._cancel.set()

    def _stop(self, error: EngineError) -> None:
        """Stop the generation on the engine's behalf (an unload past its grace period)."""
        self._stopped_with = error
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, timeout_s: float | None = None) -> Iterator[GenerationEvent]:
        """Yield events; ``timeout_s`` bounds the wait for each one (EngineBusy after)."""
        try:
            while not self._done:
                try:
                    event = self._events.get(timeout=timeout_s)
                except queue.Empty:
                    raise EngineBusy(f"no event for request {self.request_id!r} within {timeout_s}s") from None
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    self._done = True
                yield event
        finally:
            if not self._done:
                self.cancel()

    def __iter__(self) -> Iterator[GenerationEvent]:
        return self.events()

    def result(self, timeout_s: float | None = None) -> GenerationResult:
        return GenerationResult.from_events(self.events(timeout_s))


__all__ = ["GenerationStream", "held_deliveries"]
