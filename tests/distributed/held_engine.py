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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOLD_AT = 8  # tokens: the late requests of the tests ask for fewer, so they never wait


def install_hold(redis_url: str, key: str) -> None:
    import redis

    from gpu_engine.api.results import TokenEvent
    from gpu_engine.runtime.stream import GenerationStream

    client = redis.Redis.from_url(redis_url)
    counts: dict[str, int] = {}
    put = GenerationStream._put

    def held_put(self: GenerationStream, event: object) -> None:
        if isinstance(event, TokenEvent):
            n = counts[self.request_id] = counts.get(self.request_id, 0) + 1
            if n == HOLD_AT:
                while client.exists(key) and not self._cancel.is_set():
                    time.sleep(0.005)
        put(self, event)

    GenerationStream._put = held_put  # type: ignore[method-assign]


def main() -> None:
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    install_hold(os.environ["REDIS_URL"], os.environ["MILLM_TEST_HOLD_KEY"])
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), "run_engine"])


if __name__ == "__main__":
    main()
