"""What travels on the engine's streams: JSON built from the protocol dataclasses.

Every stream entry has one field, ``data``, holding a JSON object; nothing is pickled, so a
web process and an engine of another build can still read each other (unknown fields
are ignored by the dataclasses' ``from_dict``).

- request stream: ``RequestEnvelope`` (kind generate | embed | score, the job, deadline);
- command stream: ``CommandEnvelope`` (kind, args, deadline);
- per-request stream: generation events (``TokenEvent`` / ``FinishEvent`` /
  ``ErrorEvent`` as ``to_dict()``), or for embed/score/commands one ``result`` entry
  ``{"type": "result", "request_id", "result": {...}}`` or an ``ErrorEvent``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import EngineError, InvalidParameter
from ..protocol import (
    EmbedJob,
    ErrorEvent,
    GenerationEvent,
    GenerationJob,
    ScoreJob,
    event_from_dict,
)
from .keys import check_id

FIELD = "data"
REQUEST_KINDS: dict[str, Any] = {"generate": GenerationJob, "embed": EmbedJob, "score": ScoreJob}
FINAL_TYPES = ("finish", "error", "result")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _loads(fields: Mapping[Any, Any]) -> dict[str, Any]:
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    if raw is None:
        raise ValueError("stream entry has no data field")
    if isinstance(raw, bytes):
        raw = raw.decode()
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise TypeError("stream entry data is not a JSON object")
    return data


@dataclass
class RequestEnvelope:
    kind: str
    request_id: str
    job: dict[str, Any]
    deadline: float  # epoch seconds: after this the client no longer waits
    sent_at: float = field(default_factory=time.time)

    @classmethod
    def for_job(cls, kind: str, job: Any, *, wait_s: float) -> RequestEnvelope:
        if kind not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {kind!r}")
        return cls(kind, check_id(job.request_id), job.to_dict(), time.time() + wait_s)

    def encode(self) -> dict[str, str]:
        return {FIELD: _dumps({"kind": self.kind, "request_id": self.request_id,
                               "job": self.job, "deadline": self.deadline,
                               "sent_at": self.sent_at})}

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> RequestEnvelope:
        d = _loads(fields)
        if d.get("kind") not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {d.get('kind')!r}")
        return cls(d["kind"], check_id(d["request_id"]), dict(d["job"]), float(d["deadline"]),
                   float(d.get("sent_at") or 0.0))

    def build_job(self) -> Any:
        """The job dataclass; a bad job raises InvalidParameter (validated on decode too)."""
        return REQUEST_KINDS[self.kind].from_dict(self.job)


@dataclass
class CommandEnvelope:
    kind: str
    command_id: str
    args: dict[str, Any]
    deadline: float
    sent_at: float = field(default_factory=time.time)

    @classmethod
    def new(cls, kind: str, command_id: str, args: dict[str, Any], *, wait_s: float
            ) -> CommandEnvelope:
        return cls(kind, check_id(command_id), args, time.time() + wait_s)

    def encode(self) -> dict[str, str]:
        return {FIELD: _dumps({"kind": self.kind, "command_id": self.command_id,
                               "args": self.args, "deadline": self.deadline,
                               "sent_at": self.sent_at})}

    @classmethod
    def decode(cls, fields: Mapping[Any, Any]) -> CommandEnvelope:
        d = _loads(fields)
        if not isinstance(d.get("kind"), str):
            raise TypeError("command has no kind")
        return cls(d["kind"], check_id(d["command_id"]), dict(d.get("args") or {}),
                   float(d["deadline"]), float(d.get("sent_at") or 0.0))


def encode_event(payload: dict[str, Any]) -> dict[str, str]:
    """A per-request stream entry from an event's ``to_dict()`` or a result dict."""
    return {FIELD: _dumps(payload)}


def result_payload(request_id: str, result: Any) -> dict[str, Any]:
    return {"type": "result", "request_id": request_id, "result": result}


def error_payload(request_id: str, exc: EngineError) -> dict[str, Any]:
    return ErrorEvent(request_id, exc.code, exc.message, exc.details).to_dict()


def decode_event(fields: Mapping[Any, Any]) -> GenerationEvent | dict[str, Any]:
    """A generation event, or the ``{"type": "result", ...}`` dict of a one-shot reply."""
    data = _loads(fields)
    if data.get("type") == "result":
        return data
    return event_from_dict(data)


def is_final(payload: Mapping[str, Any]) -> bool:
    return payload.get("type") in FINAL_TYPES


def job_error(exc: BaseException) -> EngineError:
    """A decoding failure as the engine error the client receives."""
    if isinstance(exc, EngineError):
        return exc
    return InvalidParameter(f"the job could not be decoded: {type(exc).__name__}: {exc}",
                            param="job")


__all__ = [
    "FIELD", "REQUEST_KINDS", "CommandEnvelope", "RequestEnvelope", "decode_event",
    "encode_event", "error_payload", "is_final", "job_error", "result_payload",
]
