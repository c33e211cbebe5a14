"""Names of every Redis key the engine and the web tier share, under one prefix.

One prefix is one engine: its command and request streams, its heartbeat and the
per-request keys. Several deployments (or several engines routed by model name) share a
Redis server by using different prefixes (ENGINE_STREAM_PREFIX).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUP = "engines"
# request and command ids become parts of key names: keep them to a safe alphabet
_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def check_id(value: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(f"ids on the engine streams must match {_ID.pattern}: {value!r}")
    return value


@dataclass(frozen=True)
class Keys:
    prefix: str = "millm"

    @property
    def commands(self) -> str:
        """load / unload / attach / detach / check / cancel_all: one engine consumes."""
        return f"{self.prefix}:engine:commands"

    @property
    def requests(self) -> str:
        """generation, embedding and scoring jobs."""
        return f"{self.prefix}:engine:requests"

    @property
    def dead_letter(self) -> str:
        """jobs and commands the engine gave up on, with the reason (operators read it)."""
        return f"{self.prefix}:engine:dead"

    @property
    def heartbeat(self) -> str:
        """JSON status of the live engine; expires ENGINE_DEAD_AFTER_S after its last write."""
        return f"{self.prefix}:engine:heartbeat"

    @property
    def owner(self) -> str:
        """the id of the engine that serves this prefix (one at a time)."""
        return f"{self.prefix}:engine:owner"

    @property
    def restore_attempts(self) -> str:
        """start-ups that began restoring the recorded state and did not finish."""
        return f"{self.prefix}:engine:restore_attempts"

    @property
    def group(self) -> str:
        return GROUP

    def events(self, request_id: str) -> str:
        """tokens and the final result of one request (or the reply to one command)."""
        return f"{self.prefix}:req:{check_id(request_id)}:events"

    def live(self, request_id: str) -> str:
        """set (with a TTL) while someone waits for the request; gone means cancelled."""
        return f"{self.prefix}:req:{check_id(request_id)}:live"

    def started(self, request_id: str) -> str:
        """the engine id that started the request (SET NX): it never runs twice."""
        return f"{self.prefix}:req:{check_id(request_id)}:started"


__all__ = ["GROUP", "Keys", "check_id"]
