"""Work run every N seconds on a daemon thread, started once per process: the batch
sweeper (batches/sweeper.py) and the capture pruner (monitoring/pruner.py).

Each run opens what database connection it needs and closes every one afterwards: the
thread holds no connection between runs (a Celery prefork worker forks its children from
the process it runs in, and a child must not inherit a live connection). A run that
raises is logged and the next one tries again; the thread never ends on a failure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections, connections


class Periodic:
    """``work`` every ``interval()`` seconds (read before each wait) on a daemon thread
    called ``name``. ``at_once``: the first run is at start rather than after one
    interval. ``log`` is the owner's logger, and ``started``, ``failed`` and ``done`` the
    events it logs: the start (with the interval), a run that raised, and a run whose
    counts (the dict ``work`` returns) are not all zero."""

    def __init__(
        self,
        name: str,
        work: Callable[[], dict[str, int]],
        *,
        interval: Callable[[], float],
        at_once: bool,
        log: Any,
        started: str,
        failed: str,
        done: str,
    ) -> None:
        self.name, self.work, self.interval, self.at_once = name, work, interval, at_once
        self.log, self.started, self.failed, self.done = log, started, failed, done
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def once(self) -> dict[str, int] | None:
        """One run; None (and a log line) when it failed: the next one tries again."""
        close_old_connections()
        try:
            return self.work()
        except Exception:  # a run that fails must not end the thread
            self.log.exception(self.failed)
            return None
        finally:
            connections.close_all()

    def start(self, stop: threading.Event | None = None) -> threading.Thread:
        """Start the thread once in this process (a later call returns the running one);
        it ends when ``stop`` is set."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self._thread
            stop = stop or threading.Event()

            def loop() -> None:
                self.log.info(self.started, interval_s=float(self.interval()))
                if not self.at_once and stop.wait(float(self.interval())):
                    return
                while True:
                    done = self.once()
                    if done and any(done.values()):
                        self.log.info(self.done, **done)
                    if stop.wait(float(self.interval())):
                        return

            self._thread = threading.Thread(target=loop, name=self.name, daemon=True)
            self._thread.start()
            return self._thread
