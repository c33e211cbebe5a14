"""What the engine process writes back over Redis: the events of a request's own stream,
its final result stored together with the acknowledgement of its job (one MULTI), and
the dead-letter stream's records of the jobs it gave up on."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from ..api.errors import EngineError
from ..api.protocol import StreamEvent
from ..api.transport import Keys, encode_event, error_event

if TYPE_CHECKING:
    from .config import ServerConfig

log = logging.getLogger("gpu_engine.server")

DEAD_LETTER_MAXLEN = 10_000


class ResultWriter:
    """Writes one engine's events, results and dead letters under ``keys``."""

    def __init__(self, client: redis.Redis, keys: Keys, config: ServerConfig, engine_id: str) -> None:
        self.redis = client
        self.keys = keys
        self.config = config
        self.engine_id = engine_id

    def emit(self, request_id: str, payload: StreamEvent) -> None:
        key = self.keys.events(request_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(key, encode_event(payload), maxlen=self.config.stream_maxlen, approximate=True)
        pipe.expire(key, self.config.result_ttl_s)
        pipe.execute()

    def store_final(
        self, stream: str, msg_id: str, request_id: str, payload: StreamEvent, dead: dict[str, Any] | None = None
    ) -> None:
        """The final event, the acknowledgement and (optionally) a dead-letter record in
        one MULTI: the entry is acked exactly when its result is stored."""
        key = self.keys.events(request_id)
        delay = 0.05
        for attempt in range(5):
            try:
                pipe = self.redis.pipeline(transaction=True)
                if dead is not None:
                    pipe.xadd(
                        self.keys.dead_letter,
                        {"data": json.dumps(dead, default=str)},
                        maxlen=DEAD_LETTER_MAXLEN,
                        approximate=True,
                    )
                pipe.xadd(key, encode_event(payload), maxlen=self.config.stream_maxlen, approximate=True)
                pipe.expire(key, self.config.result_ttl_s)
                pipe.xack(stream, self.keys.group, msg_id)
                pipe.xdel(stream, msg_id)
                pipe.execute()
                return
            except redis.RedisError as exc:
                if attempt == 4:
                    # left pending: reclaimed later, its client told then
                    log.error("engine_result_not_stored request_id=%s error=%r", request_id, exc)
                    return
                time.sleep(delay)
                delay *= 2

    def dead_record(self, stream: str, msg_id: str, fields: Any, reason: str, error: str) -> dict[str, Any]:
        raw = fields.get("data") if isinstance(fields, dict) else None
        return {
            "reason": reason,
            "stream": stream,
            "id": msg_id,
            "entry": raw,
            "engine_id": self.engine_id,
            "time": time.time(),
            "error": error,
        }

    def dead_letter(self, stream: str, msg_id: str, fields: Any, reason: str, error: str) -> None:
        log.error("engine_dead_letter stream=%s id=%s reason=%s", stream, msg_id, reason)
        self.redis.xadd(
            self.keys.dead_letter,
            {"data": json.dumps(self.dead_record(stream, msg_id, fields, reason, error), default=str)},
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )

    def give_up(self, stream: str, msg_id: str, fields: Any, request_id: str, reason: str, error: EngineError) -> None:
        log.error("engine_dead_letter stream=%s id=%s request_id=%s reason=%s", stream, msg_id, request_id, reason)
        self.store_final(
            stream,
            msg_id,
            request_id,
            error_event(request_id, error),
            dead=self.dead_record(stream, msg_id, fields, reason, error.message),
        )


__all__ = ["DEAD_LETTER_MAXLEN", "ResultWriter"]
