"""The engine's capture writer: one daemon thread that packs finished requests' capture
artifacts (serialises them, writes stored ones under the capture directory) and only then
hands each request its final event.

Why: the engine's worker thread runs every forward pass of the batch; a capture near
``CAPTURE_MAX_BYTES`` packed there would hold every other row for as long as its file
takes to write.  The worker now does only the device-to-host copy of the rows
(``CapturePlan.finish`` on a ``deferred`` plan) and queues the ``Artifact`` with the
request's ``FinishEvent``; this thread packs it (``Artifact.pack``), sets the event's
``capture`` and delivers the event.  A client is told a capture id only once the file is
whole under its name (temporary name, flushed, renamed), so an id it is given never 404s.

- **Order.** One thread, first in first out.  A request's token events are all handed
  over before its artifact is queued (the batch scheduler queues after its phase's
  ``held_deliveries`` burst), so its final event comes last.
- **Backpressure.** At most ``MAX_PENDING`` artifacts wait; the worker blocks on the next
  one until a place is free (host memory stays bounded: each holds up to
  ``CAPTURE_MAX_BYTES`` of rows).
- **Errors.** An ``EngineError`` from packing (``CaptureDiskFull``: ``capture_store_full``;
  ``CaptureWriteFailed``: ``generation_failed``) ends that request alone with its code;
  anything else is logged and ends it with ``generation_failed``.  No partial file is
  left under the capture's names.
- **Shutdown.** ``close`` stops taking artifacts and writes those queued (the engine calls
  it after its worker has stopped); any still queued when its wait ends are failed with
  ``engine_shutdown`` instead of being written, and an artifact handed over after
  ``close`` likewise: every request gets a final event, and none is told of a file that
  is not there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..api.errors import EngineError, EngineShutdown, GenerationFailed
from ..api.protocol import ErrorEvent, FinishEvent
from ..interp.capture import Artifact

log = logging.getLogger("gpu_engine")

# artifacts waiting for the writer before the engine's worker waits for a free place
MAX_PENDING = 2

Emit = Callable[[Any], None]


class CaptureWriter:
    """See the module doc."""

    def __init__(self, *, max_pending: int = MAX_PENDING) -> None:
        self._queue: queue.Queue[tuple[Artifact, FinishEvent, Emit] | None] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._closed = False
        self._abandon = False
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="millm-capture-writer", daemon=True)
        self._thread.start()

    def submit(self, artifact: Artifact, event: FinishEvent, emit: Emit) -> None:
        """Pack ``artifact`` into ``event.capture`` on the writer thread, then ``emit(event)``
        (or ``emit`` the request's error).  Blocks while ``MAX_PENDING`` artifacts wait."""
        with self._lock:  # so ``close`` never slips its stop in ahead of this artifact
            if not self._closed:
                self._queue.put((artifact, event, emit))
                return
        self._fail(artifact, emit, EngineShutdown("the engine shut down before the capture was written"))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            artifact, event, emit = item
            if self._abandon:
                self._fail(artifact, emit, EngineShutdown("the engine shut down before the capture was written"))
                continue
            self.write(artifact, event, emit)

    def write(self, artifact: Artifact, event: FinishEvent, emit: Emit) -> None:
        """Pack one artifact and deliver its request's final event (on this thread)."""
        try:
            event.capture = self.pack(artifact)
        except EngineError as exc:
            self._fail(artifact, emit, exc)
            return
        except Exception as exc:  # noqa: BLE001 - this request's failure, reported on its stream
            log.exception("writing the capture of %s failed", artifact.request_id)
            self._fail(artifact, emit, GenerationFailed(f"the capture could not be packed: {type(exc).__name__}"))
            return
        self.written += 1
        emit(event)

    def pack(self, artifact: Artifact) -> Any:
        """``artifact.pack()``; a seam for a test that holds the writer at a point of its own."""
        return artifact.pack()

    def _fail(self, artifact: Artifact, emit: Emit, err: EngineError) -> None:
        self.failed += 1
        emit(ErrorEvent(artifact.request_id, err.code, err.message, err.details))

    def close(self, timeout_s: float | None = None) -> bool:
        """Take no more artifacts; write those queued, waiting at most ``timeout_s``. Past
        it the ones still queued are failed (``engine_shutdown``) rather than written.
        True when every artifact was written or failed in time."""
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
        if not self._thread.is_alive():
            self._abandon = True
            self._fail_queued()
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._put_stop(deadline)
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            return True
        log.warning("engine shutdown: the capture writer did not finish within %ss", timeout_s)
        self._abandon = True  # the one being written finishes; the rest are failed
        self._fail_queued()
        return False

    def _put_stop(self, deadline: float | None) -> None:
        try:
            self._queue.put(None, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._abandon = True
            self._fail_queued()
            self._queue.put(None)

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.put_nowait(None)  # the writer's stop stays for it
                return
            artifact, _, emit = item
            self._fail(artifact, emit, EngineShutdown("the engine shut down before the capture was written"))

    def status(self) -> dict[str, int]:
        return {"pending": self._queue.qsize(), "written": self.written, "failed": self.failed}


def deliver(writer: CaptureWriter, capture: Any, event: FinishEvent, emit: Emit) -> None:
    """A request's final event: straight to ``emit``, or — when its capture plan left an
    artifact to pack (``CapturePlan.deferred``) — through ``writer``."""
    artifact = capture.pending if capture is not None else None
    if artifact is None:
        emit(event)
        return
    capture.pending = None
    writer.submit(artifact, event, emit)


__all__ = ["MAX_PENDING", "CaptureWriter", "deliver"]
