"""``manage.py run_engine`` with a hold the test controls: a generation that reaches its
``HOLD_AT``-th token while the Redis key ``MILLM_TEST_HOLD_KEY`` exists waits there —
still accepted work, so a drain waits for it — until the test deletes the key or the
generation is cancelled (its client left, or the engine stopped it: an unload whose grace
period ran out).  The engine's worker thread waits with it; status and the heartbeat are
read off that thread and stay live.

``MILLM_TEST_HOLD_AT`` sets the token (default 8; 1 holds a dashboard's one-token
contexts).  With ``MILLM_TEST_HOLD_REACHED`` set, the first generation to reach the hold
creates that file: the test's event that the engine is holding work.

A test that needs "a stream still running while I check something" holds it instead of
choosing a stream long enough for the slowest machine and short enough for the fastest.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOLD_AT = 8  # tokens: the late requests of the tests ask for fewer, so they never wait


def install_hold(held: Callable[[], bool], at: int = HOLD_AT, reached: Path | None = None) -> None:
    """Hold each generation at its ``at``-th token while ``held()`` is true (and it is not
    cancelled); ``reached``, when given, is created once a generation waits there."""
    from gpu_engine.api.results import TokenEvent
    from gpu_engine.runtime.stream import GenerationStream

    counts: dict[str, int] = {}
    put = GenerationStream._put

    def held_put(self: GenerationStream, event: object) -> None:
        if isinstance(event, TokenEvent):
            n = counts[self.request_id] = counts.get(self.request_id, 0) + 1
            if n == at and held() and not self._cancel.is_set():
                if reached is not None:
                    reached.touch()
                while held() and not self._cancel.is_set():
                    time.sleep(0.005)
        put(self, event)

    GenerationStream._put = held_put  # type: ignore[method-assign]


def main() -> None:
    """``held_engine.py``: run_engine, held while the Redis key exists; ``held_engine.py
    daphne ARGS`` (daphne) or ``held_engine.py serve ARGS`` (``manage.py serve ARGS``):
    the embedded engine, held while the file ``MILLM_TEST_HOLD_FILE`` exists (the
    embedded topology has no Redis of its own)."""
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    at = int(os.environ.get("MILLM_TEST_HOLD_AT", HOLD_AT))
    reached = Path(os.environ["MILLM_TEST_HOLD_REACHED"]) if os.environ.get("MILLM_TEST_HOLD_REACHED") else None
    if sys.argv[1:2] == ["serve"]:
        hold_file = Path(os.environ["MILLM_TEST_HOLD_FILE"])
        install_hold(hold_file.exists, at, reached)
        from django.core.management import execute_from_command_line

        execute_from_command_line([str(REPO / "manage.py"), "serve", *sys.argv[2:]])
        return
    if sys.argv[1:2] == ["daphne"]:
        hold_file = Path(os.environ["MILLM_TEST_HOLD_FILE"])
        install_hold(hold_file.exists, at, reached)
        from daphne.cli import CommandLineInterface

        sys.argv = ["daphne", *sys.argv[2:]]
        CommandLineInterface.entrypoint()
        return
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    key = os.environ["MILLM_TEST_HOLD_KEY"]
    install_hold(lambda: bool(client.exists(key)), at, reached)
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), "run_engine"])


if __name__ == "__main__":
    main()
