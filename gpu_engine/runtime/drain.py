"""The engine's ledger of accepted work, and draining it before a control operation.

Work is accepted and not finished from ``admit`` to ``ended``: a generation until its
last event (its ``GenerationStream``), an embedding or a score until answered (a call),
whoever sent it. An unload or a model swap waits for that work, wherever it was asked
from (``drained``); while it does, new work is refused with engine_busy (503 model_busy
on /v1), and what outlasts the grace period is stopped (an unload) or makes the operation
give up (a load). The ``Engine`` owns one ledger and runs the operation on its worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..api.errors import EngineBusy
from .stream import GenerationStream

log = logging.getLogger("gpu_engine")

# How long stopped generations get to end (they stop before their next forward pass) and a
# control operation gets to start after a drain, at least.
STOP_WAIT_S = 10.0


class WorkLedger:
    """Work accepted and not finished, and the drain under way (if any)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._streams: set[GenerationStream] = set()
        self._calls = 0
        self._draining: str | None = None
        self._draining_model: str | None = None

    @property
    def draining(self) -> str | None:
        """What the drain under way is for ("loading", "unloading"), or None."""
        return self._draining

    def live(self) -> int:
        return len(self._streams) + self._calls

    def admit(self, stream: GenerationStream | None = None) -> EngineBusy | None:
        """Count new work in, or say why it is refused (a drain is under way)."""
        with self._cv:
            if self._draining is not None:
                return EngineBusy(
                    f"the engine is {self._draining} model {self._draining_model!r}; retry shortly",
                    details={"reason": self._draining, "model_id": self._draining_model},
                )
            if stream is None:
                self._calls += 1
            else:
                self._streams.add(stream)
            return None

    def ended(self, stream: GenerationStream | None = None) -> None:
        with self._cv:
            if stream is None:
                self._calls -= 1
            else:
                self._streams.discard(stream)
            self._cv.notify_all()

    def wait(self, deadline: float) -> bool:
        """Wait until no accepted work is left, or ``deadline``; True when none is left."""
        with self._cv:
            while self.live():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def drained(
        self, reason: str, model_id: str | None, timeout: float, *, stop_after: bool, run: Callable[[], Any]
    ) -> Any:
        """``run()`` (the control operation) once the work already accepted has finished:
        new work is refused from now on; what is still running after ``timeout`` seconds is
        stopped (its clients get engine_busy) when ``stop_after``, else the operation is
        refused with engine_busy and serving resumes."""
        with self._cv:
            if self._draining is not None:
                raise EngineBusy(
                    f"the engine is already {self._draining} model {self._draining_model!r}",
                    details={"reason": self._draining},
                )
            self._draining, self._draining_model = reason, model_id
        try:
            if not self.wait(time.monotonic() + timeout):
                if not stop_after:
                    raise EngineBusy(
                        "timed out waiting for in-flight work to drain",
                        details={"timeout_s": timeout, "in_flight": self.live()},
                    )
                with self._cv:
                    streams = list(self._streams)
                log.warning(
                    "%s: %d request(s) outlasted the %.1fs grace period; stopping them", reason, len(streams), timeout
                )
                error = EngineBusy(
                    f"the request was stopped: the engine is {reason} model {model_id!r} "
                    f"and the {timeout:g}s grace period ran out",
                    details={"reason": reason},
                )
                for stream in streams:
                    stream._stop(error)
                # a stopped generation ends before its next forward pass
                self.wait(time.monotonic() + max(timeout, STOP_WAIT_S))
            return run()
        finally:
            with self._cv:
                self._draining = self._draining_model = None

    def cancel_all(self, reason: str) -> int:
        """Stop every running generation; their clients get ``engine_busy``."""
        with self._cv:
            streams = list(self._streams)
        error = EngineBusy(f"the request was stopped by the server ({reason})", details={"reason": reason})
        for stream in streams:
            stream._stop(error)
        if streams:
            log.warning("cancel_all stopped %d generation(s): %s", len(streams), reason)
        return len(streams)


__all__ = ["STOP_WAIT_S", "WorkLedger"]
