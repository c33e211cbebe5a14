"""Which engine client this process uses: the embedded engine or the Redis one.

Its own module because it names both implementations: ``core.engine_client_redis``
builds on ``core.engine_client``, so the choice cannot live in either without a circle.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings

from core.engine_client import EmbeddedEngineClient, EngineClient
from gpu_engine.api.protocol import EngineEvent


def build_engine_client(*, on_event: Callable[[EngineEvent], None] | None = None) -> EngineClient:
    """The engine client this process's settings call for (the runtime builds it once):
    the engine in this process when embedded; with REDIS_URL set, the run_engine process
    over Redis Streams, and nothing here imports torch."""
    if not settings.EMBEDDED:
        from core.engine_client_redis import RedisEngineClient

        return RedisEngineClient.from_settings()
    return EmbeddedEngineClient(on_event=on_event)
