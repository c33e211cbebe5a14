"""Which engine client this process uses: the embedded engine or the Redis one.

Its own module because it names both implementations: ``core.engine_client_redis``
builds on ``core.engine_client``, so the choice cannot live in either without a circle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.conf import settings

from core.engine_client import EmbeddedEngineClient, EngineClient
from core.engines import DEFAULT_ENGINE, engine_names, engine_prefix
from core.errors import ValidationFailed
from gpu_engine.api.protocol import EngineEvent


def build_engine_client(*, on_event: Callable[[EngineEvent], None] | None = None) -> EngineClient:
    """The engine client this process's settings call for (the runtime builds it once):
    the engine in this process when embedded; with REDIS_URL set, the run_engine process
    over Redis Streams, and nothing here imports torch."""
    if not settings.EMBEDDED:
        from core.engine_client_redis import RedisEngineClient

        return RedisEngineClient.from_settings()
    return EmbeddedEngineClient(on_event=on_event)


class EngineSet:
    """Every engine's client by name (``ENGINE_MODELS``); the default engine's is the
    runtime's ``engine`` part itself. The others are Redis clients on their own prefix
    (``core.engines.engine_prefix``), built on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, EngineClient] = {}

    def names(self) -> list[str]:
        return engine_names()

    def client(self, name: str) -> EngineClient:
        from core.runtime import runtime

        if name == DEFAULT_ENGINE:
            with _default_selected():
                return runtime().engine
        if name not in engine_names():
            raise ValidationFailed(f"No engine named {name!r} (ENGINE_MODELS)", details={"engine": name})
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                from core.engine_client_redis import RedisEngineClient

                client = self._clients[name] = RedisEngineClient.from_settings(prefix=engine_prefix(name))
            return client

    def built(self, name: str) -> EngineClient | None:
        """Engine ``name``'s client if it exists already (a report must not build one)."""
        from core.runtime import runtime

        if name == DEFAULT_ENGINE:
            return runtime().built("engine")
        with self._lock:
            return self._clients.get(name)

    def shutdown(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.shutdown()


def _default_selected():
    from core.engines import using_engine

    return using_engine(DEFAULT_ENGINE)
