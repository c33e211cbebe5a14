"""A value read from the database and kept in this process, so that a /v1 request can use
it without a database read (and without the thread hop a read costs on the event loop).

The copy is dropped at once when this process changes the value (the writer calls
``invalidate``, after its transaction commits). What another process may change:

- **embedded**: no other process changes it (the API, the admin and the in-process tasks
  all run in the server's process), so the copy stays until this process drops it. No
  thread runs beside the engine: on a small CPU any runnable thread takes a core from
  the engine's OpenMP team during a forward pass (measured: +20 ms on a 140 ms first
  token), which is why a background re-read is not done here;
- **distributed**: other web workers and Celery workers change it, so a copy that requests
  are using is read again every half ``fresh_s`` in the background (``_Refresher``, a
  thread that runs while requests keep asking and stops when they stop; the web tier runs
  no model), and a change made elsewhere is seen within ``fresh_s``.

Used for what every request reads and few requests change: the monitoring configuration
and the live steering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger(__name__)

FRESH_S = 1.0
# the refresher stops after this long without a request asking for a copy
IDLE_S = 10.0


class ProcessCopy(Generic[T]):
    def __init__(self, load: Callable[[], T], fresh_s: float = FRESH_S) -> None:
        self.load = load  # reads the database (on a thread that may)
        self.fresh_s = fresh_s
        self._lock = threading.Lock()
        self._value: T | None = None
        self._read_at = float("-inf")
        self._followers: list[ProcessCopy[Any]] = []

    def fresh(self) -> T | None:
        """The copy, or None when there is none (or, with other processes that may change
        it, when it is older than ``fresh_s``): the caller then reads the database,
        through ``read``. With other processes, asking keeps the copy read again in the
        background while requests keep asking."""
        from django.conf import settings

        exact = settings.EMBEDDED
        if not exact:
            refresher.wanted(self)
        with self._lock:
            if self._read_at > float("-inf") and (exact or time.monotonic() - self._read_at < self.fresh_s):
                return self._value
            return None

    def read(self) -> T:
        """The value from the database, kept as the copy."""
        value = self.load()
        with self._lock:
            self._value, self._read_at = value, time.monotonic()
        return value

    def invalidate(self) -> None:
        with self._lock:
            self._value, self._read_at = None, float("-inf")
        for follower in self._followers:
            follower.invalidate()

    def followed_by(self, other: ProcessCopy[Any]) -> None:
        """``other`` is dropped whenever this copy is (a copy derived from what this one
        holds, kept by a package above it)."""
        if other not in self._followers:
            self._followers.append(other)


class _Refresher:
    """Reads the copies requests use again every half ``fresh_s``, on a thread of its own,
    while requests keep asking (``IDLE_S``); closes its database connection when it stops
    (a held connection would pin a PostgreSQL session)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: set[ProcessCopy] = set()
        self._asked_at = 0.0
        self._thread: threading.Thread | None = None

    def wanted(self, copy: ProcessCopy) -> None:
        from django.conf import settings

        if not settings.MILLM_PROCESS_COPY_REFRESH:
            return
        with self._lock:
            self._copies.add(copy)
            self._asked_at = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="millm-process-copies")
                self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to stop (after ``MILLM_PROCESS_COPY_REFRESH`` is turned
        off, or ``IDLE_S``); True when none runs."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        from django.conf import settings
        from django.db import connections

        try:
            while True:
                with self._lock:
                    if time.monotonic() - self._asked_at > IDLE_S or not settings.MILLM_PROCESS_COPY_REFRESH:
                        self._thread = None
                        return
                    copies = list(self._copies)
                for copy in copies:
                    try:
                        copy.read()
                    except Exception:  # noqa: BLE001 - requests read it themselves then
                        copy.invalidate()
                        log.warning("process_copy_refresh_failed", exc_info=True)
                time.sleep(min(c.fresh_s for c in copies) / 2 if copies else FRESH_S)
        finally:
            connections.close_all()


refresher = _Refresher()
