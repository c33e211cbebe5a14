"""What travels on the engine's Redis streams, and under which names: the web tier's client
(``core.engine_client_redis``) and the engine's server (``gpu_engine.server``) both speak it.

Names: every Redis key the engine and the web tier share, under one prefix (``Keys``). One
prefix is one engine: its command and request streams, its heartbeat and the per-request
keys. Several deployments (or several engines routed by model name) share a Redis server by
using different prefixes (ENGINE_STREAM_PREFIX).

Messages: JSON of the protocol structs (never pickle).

Every stream entry has one field, ``data``, holding a JSON object encoded by msgspec from
the typed structs of ``protocol`` and ``commands``; unknown fields are ignored when
decoding, so a web process and an engine of another build can still read each other.

- command and request streams: an ``Envelope`` — a command's name (``kind``, a key of
  ``COMMANDS``), the id of the stream its reply goes to, its argument struct as JSON
  (``args``) and the deadline after which nobody waits for it;
- per-request stream: generation events (``TokenEvent`` / ``FinishEvent`` /
  ``ErrorEvent``), or for every other command one ``ResultEvent`` (the declared result
  type as JSON) or an ``ErrorEvent``; each carries its ``type`` tag.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from .commands import COMMANDS, Command
from .errors import EngineError, InvalidParameter
from .protocol import ErrorEvent, FinishEvent, ResultEvent, StreamEvent, from_json, to_json

# --- names ---------------------------------------------------------------------------------

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


# --- messages ------------------------------------------------------------------------------

FIELD = "data"


def _raw(fields: Mapping[Any, Any]) -> str | bytes:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    if raw is None:
        raise ValueError("stream entry has no data field")
    return raw


class Envelope(msgspec.Struct):
    kind: str
    request_id: str  # names the reply stream and the live / started keys
    args: msgspec.Raw
    deadline: float  # epoch seconds: after this the client no longer waits
    sent_at: float = 0.0

    @classmethod
    def new(cls, command: Command, request_id: str, args: msgspec.Struct, *, wait_s: float) -> Envelope:
        if not isinstance(args, command.args):
            raise TypeError(f"{command.name} takes {command.args.__name__}")
        now = time.time()
        return cls(command.name, check_id(request_id), msgspec.Raw(to_json(args)), now + wait_s, now)

    def encode(self) -> dict[str, str]:
        return {FIELD: to_json(self).decode()}

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> Envelope:
        env: Envelope = from_json(_raw(fields), cls)
        check_id(env.request_id)
        return env

    @property
    def command(self) -> Command:
        try:
            return COMMANDS[self.kind]
        except KeyError:
            raise InvalidParameter(f"unknown engine command {self.kind!r}", param="kind") from None

    def build_args(self) -> msgspec.Struct:
        """The command's argument struct; a bad one raises InvalidParameter."""
        return from_json(self.args, self.command.args)


def encode_event(event: StreamEvent) -> dict[str, str]:
    """A per-request stream entry."""
    return {FIELD: to_json(event).decode()}


def decode_event(fields: Mapping[Any, Any]) -> StreamEvent:
    return from_json(_raw(fields), StreamEvent)


def result_event(request_id: str, result: Any) -> ResultEvent:
    return ResultEvent(request_id, msgspec.Raw(to_json(result)))


def error_event(request_id: str, exc: EngineError) -> ErrorEvent:
    return ErrorEvent(request_id, exc.code, exc.message, exc.details)


def is_final(event: StreamEvent) -> bool:
    """The last entry of its stream (everything but a token)."""
    return isinstance(event, (FinishEvent, ErrorEvent, ResultEvent))


def job_error(exc: BaseException) -> EngineError:
    """A decoding failure as the engine error the client receives."""
    if isinstance(exc, EngineError):
        return exc
    return InvalidParameter(f"the job could not be decoded: {type(exc).__name__}: {exc}", param="job")


__all__ = [
    "FIELD",
    "GROUP",
    "Envelope",
    "Keys",
    "check_id",
    "decode_event",
    "encode_event",
    "error_event",
    "is_final",
    "job_error",
    "result_event",
]
