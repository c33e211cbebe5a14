"""What the tests of background runs (feature dashboards, experiments) share: waiting for a
condition or for a run to end, and a run's runner called by hand on a thread of its own
while a gated engine (tests/fixtures/served.GatedEngine) stands in for the runtime's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TERMINAL = ("completed", "failed", "cancelled")


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 300.0) -> Any:
    """``check()``'s first truthy answer, polled every 50 ms; an AssertionError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_ended(model: Any, run_id: str, timeout_s: float = 300.0) -> Any:
    """The run (a row of ``model``: DashboardRun, ExperimentRun) once it has ended and its
    runner has let it go."""
    return wait_until(
        lambda: (r := model.objects.get(id=run_id)).status in TERMINAL and r.runner is None and r,
        f"run {run_id} to end",
        timeout_s,
    )


@contextmanager
def runner_by_hand(
    gate: Any, run: Callable[[threading.Event], str]
) -> Iterator[tuple[threading.Event, list[str], threading.Thread]]:
    """``run(stop)`` (a runner's entry point) on a thread, the runtime's engine replaced by
    ``gate``; yields (stop, outcome, thread): ``outcome`` gets what ``run`` returned. On
    leaving, the gate lets its held jobs go and the thread is joined (120 s)."""
    from core.runtime import runtime

    stop = threading.Event()
    outcome: list[str] = []
    with runtime().replaced(engine=gate):
        thread = threading.Thread(target=lambda: outcome.append(run(stop)))
        thread.start()
        try:
            yield stop, outcome, thread
        finally:
            gate.release.set()
            thread.join(120)
