"""``manage.py run_engine`` with a hold the test controls: a generation that reaches its
``HOLD_AT``-th token while the Redis key ``MILLM_TEST_HOLD_KEY`` exists waits there —
still accepted work, so a drain waits for it — until the test deletes the key or the
engine stops the generation (an unload whose grace period ran out).  The engine's worker
thread waits with it; status and the heartbeat are read off that thread and stay live.

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


def install_hold(held: Callable[[], bool]) -> None:
    """Hold each generation at its ``HOLD_AT``-th token while ``held()`` is true."""
    from gpu_engine.api.results import TokenEvent
    from gpu_engine.runtime.stream import GenerationStream

    counts: dict[str, int] = {}
    put = GenerationStream._put

    def held_put(self: GenerationStream, event: object) -> None:
        if isinstance(event, TokenEvent):
            n = counts[self.request_id] = counts.get(self.request_id, 0) + 1
            if n == HOLD_AT:
                while held() and not self._cancel.is_set():
                    time.sleep(0.005)
        put(self, event)

    GenerationStream._put = held_put  # type: ignore[method-assign]


def main() -> None:
    """``held_engine.py``: run_engine, held while the Redis key exists; ``held_engine.py
    daphne ARGS``: daphne with the embedded engine, held while the file
    ``MILLM_TEST_HOLD_FILE`` exists (the embedded topology has no Redis of its own)."""
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    if sys.argv[1:2] == ["daphne"]:
        hold_file = Path(os.environ["MILLM_TEST_HOLD_FILE"])
        install_hold(hold_file.exists)
        from daphne.cli import CommandLineInterface

        sys.argv = ["daphne", *sys.argv[2:]]
        CommandLineInterface.entrypoint()
        return
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    key = os.environ["MILLM_TEST_HOLD_KEY"]
    install_hold(lambda: bool(client.exists(key)))
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), "run_engine"])


if __name__ == "__main__":
    main()
