"""What travels on the engine's streams: JSON of the protocol structs (never pickle).

Every stream entry has one field, ``data``, holding a JSON object encoded by msgspec
from the typed structs of ``gpu_engine.api.protocol`` and ``gpu_engine.api.commands``; unknown
fields are ignored when decoding, so a web process and an engine of another build can
still read each other.

- command and request streams: an ``Envelope`` — a command's name (``kind``, a key of
  ``COMMANDS``), the id of the stream its reply goes to, its argument struct as JSON
  (``args``) and the deadline after which nobody waits for it;
- per-request stream: generation events (``TokenEvent`` / ``FinishEvent`` /
  ``ErrorEvent``), or for every other command one ``ResultEvent`` (the declared result
  type as JSON) or an ``ErrorEvent``; each carries its ``type`` tag.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from ..api.commands import COMMANDS, Command
from ..api.errors import EngineError, InvalidParameter
from ..api.protocol import ErrorEvent, FinishEvent, ResultEvent, StreamEvent, from_json, to_json
from .keys import check_id

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
    def new(cls, command: Command, request_id: str, args: msgspec.Struct, *, wait_s: float
            ) -> Envelope:
        if not isinstance(args, command.args):
            raise TypeError(f"{command.name} takes {command.args.__name__}")
        now = time.time()
        return cls(command.name, check_id(request_id), msgspec.Raw(to_json(args)), now + wait_s,
                   now)

    def encode(self) -> dict[str, str]:
        return {FIELD: to_json(self).decode()}

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> Envelope:
        env = from_json(_raw(fields), cls)
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
    return InvalidParameter(f"the job could not be decoded: {type(exc).__name__}: {exc}",
                            param="job")


__all__ = [
    "FIELD", "Envelope", "decode_event", "encode_event", "error_event", "is_final",
    "job_error", "result_event",
]
