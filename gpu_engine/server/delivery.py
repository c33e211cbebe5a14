"""Which entries of the engine's streams may run (docs/deploy.md has the long form):
reading XREADGROUP's answer, decoding an entry (a malformed one is dead-lettered), the
checks before a job starts (more than ``max_deliveries`` deliveries, a client that stopped
waiting, the ``started:<request_id>`` marker set NX so nothing runs twice), and taking
over the entries a dead engine read and never acknowledged (XAUTOCLAIM). ``EngineServer``
reads and runs; this decides whether an entry it read is work or is settled here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from ..api.errors import EngineBusy, EngineShutdown, GenerationFailed
from ..api.transport import Envelope, Keys, error_event
from .results import ResultWriter

if TYPE_CHECKING:
    from .config import ServerConfig

log = logging.getLogger("gpu_engine.server")


def read_entries(response: Any) -> list[tuple[str, list[tuple[str, Any]]]]:
    """XREADGROUP's answer as [(stream, [(id, fields)])] under RESP2 and RESP3."""
    if not response:
        return []
    if isinstance(response, dict):
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in response.items()]
    return [(stream, entries) for stream, entries in response]


class Delivery:
    """The delivery checks of one engine (``engine_id``) under ``keys``."""

    def __init__(
        self, client: redis.Redis, keys: Keys, config: ServerConfig, engine_id: str, results: ResultWriter
    ) -> None:
        self.redis = client
        self.keys = keys
        self.config = config
        self.engine_id = engine_id
        self.results = results

    def reclaim(
        self,
        stream: str,
        accept: Callable[[str, Any, int], None],
        *,
        room: Callable[[], int],
        stopping: threading.Event,
    ) -> None:
        """Take over entries a dead engine read and never acknowledged, as many per page
        as ``room()`` says the engine can take, until ``stopping``."""
        start = "0-0"
        for _ in range(100):  # bounded: at most 100 pages per pass
            count = room()
            if count <= 0 or stopping.is_set():
                return
            result = self.redis.xautoclaim(
                stream,
                self.keys.group,
                self.engine_id,
                min_idle_time=self.config.dead_after_ms,
                start_id=start,
                count=count,
            )
            start, claimed = result[0], result[1]
            deleted = result[2] if len(result) > 2 else []
            if deleted:
                self.redis.xack(stream, self.keys.group, *deleted)
            for msg_id, fields in claimed:
                if not fields:  # deleted from the stream meanwhile
                    self.redis.xack(stream, self.keys.group, msg_id)
                    continue
                info = self.redis.xpending_range(stream, self.keys.group, msg_id, msg_id, 1)
                delivered = int(info[0]["times_delivered"]) if info else 1
                log.warning("engine_reclaimed stream=%s id=%s deliveries=%d", stream, msg_id, delivered)
                accept(msg_id, fields, delivered)
            if start in ("0-0", b"0-0"):
                return

    def claim_start(
        self, stream: str, msg_id: str, fields: Any, request_id: str, delivered: int, deadline: float
    ) -> bool:
        """The checks before work starts; False when the entry was settled here."""
        if delivered > self.config.max_deliveries:
            self.results.give_up(
                stream,
                msg_id,
                fields,
                request_id,
                "max_deliveries",
                GenerationFailed(
                    f"the job was delivered {delivered} times without finishing (each time the "
                    "engine stopped while holding it); it was moved to the dead-letter stream",
                    details={"deliveries": delivered},
                ),
            )
            return False
        started_key = self.keys.started(request_id)
        starter = self.redis.get(started_key)
        if starter is None:
            if time.time() > deadline or not self.redis.exists(self.keys.live(request_id)):
                # nobody waits for it any more (the client left or gave up): drop it unrun
                log.info("engine_dropped_abandoned id=%s request_id=%s", msg_id, request_id)
                self.results.store_final(
                    stream,
                    msg_id,
                    request_id,
                    error_event(request_id, EngineBusy("the client stopped waiting before the job started")),
                )
                return False
            if self.redis.set(started_key, self.engine_id, nx=True, ex=self.config.result_ttl_s):
                return True
            starter = self.redis.get(started_key)
        self.results.give_up(
            stream,
            msg_id,
            fields,
            request_id,
            "engine_died_while_running",
            EngineShutdown(
                f"the engine process running this job ({starter}) stopped before it finished; it is not run again",
                details={"started_by": starter},
            ),
        )
        return False

    def decode(self, stream: str, msg_id: str, fields: Any) -> Envelope | None:
        """The entry's envelope, or None once a malformed entry (it names no reply
        stream, so it cannot be answered) was dead-lettered."""
        try:
            return Envelope.decode(fields)
        except Exception as exc:  # noqa: BLE001 - a malformed entry is dead-lettered
            self.results.dead_letter(stream, msg_id, fields, "undecodable", repr(exc))
            self.redis.xack(stream, self.keys.group, msg_id)
            self.redis.xdel(stream, msg_id)
            return None
