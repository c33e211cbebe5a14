"""A value read from the database and kept in this process, so that a /v1 request can use
it without a database read (and without the thread hop a read costs on the event loop).

The copy is dropped at once when this process changes the value (the writer calls
``invalidate``, after its transaction commits) and is read again at most ``fresh_s`` after
the last read, so a change made by another process (another web worker) is seen within
that time. Used for what every request reads and few requests change: the monitoring
configuration and the live steering.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")

FRESH_S = 1.0


class ProcessCopy(Generic[T]):
    def __init__(self, fresh_s: float = FRESH_S) -> None:
        self.fresh_s = fresh_s
        self._lock = threading.Lock()
        self._value: T | None = None
        self._read_at = float("-inf")

    def fresh(self) -> T | None:
        """The copy, or None when there is none or it is older than ``fresh_s``."""
        with self._lock:
            if time.monotonic() - self._read_at < self.fresh_s:
                return self._value
            return None

    def keep(self, value: T) -> T:
        """Remember ``value`` as just read from the database."""
        with self._lock:
            self._value, self._read_at = value, time.monotonic()
        return value

    def invalidate(self) -> None:
        with self._lock:
            self._value, self._read_at = None, float("-inf")
