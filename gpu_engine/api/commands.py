"""The engine's API, declared once: every command's name, argument type and result type.

``COMMANDS`` is the one list of what the web tier may ask of an engine. Everything that
speaks to an engine dispatches from it:

- ``Engine`` has a method per command (``check_implements`` runs at import of
  ``gpu_engine.runtime.engine``), called as ``getattr(engine, name)(**args)``: the argument
  struct's fields are the method's parameters, in order;
- the embedded client (``core.engine_client``) runs ``command.call(engine, args)`` in
  this process;
- the Redis client (``core.engine_client_redis``) sends the command's name and its
  arguments as JSON on the lane's stream and decodes the declared result type;
- the engine server (``gpu_engine.server``) decodes the arguments by the name and calls
  the same ``command.call`` on its engine.

A command therefore cannot exist on one side only: a new one is one ``Command`` here plus
the ``Engine`` method, and both transports carry it.

The lane says how a command travels when the engine is in another process:

- ``state``: answered from the engine's heartbeat, whose key ``<name>`` holds the latest
  result (no round trip; the web tier answers at once);
- ``control``: the command stream, one at a time (load, unload, attach, detach, checks);
- ``work``: the request stream, one result entry (embed, score, hidden_states, tokenize,
  feature_logits, attribution);
- ``stream``: the request stream, token events then a final one (generate).

``work`` and ``stream`` arguments carry a ``job`` whose ``request_id`` names the request's
keys. A ``timeout_s`` argument bounds the engine's wait for its worker; ``None`` is the
transport's default.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from .protocol import (
    AttachResult,
    AttachSpec,
    AttributionJob,
    AttributionResult,
    CompatibilityReport,
    EmbedJob,
    EmbedResult,
    EngineStatus,
    FeatureLogitsJob,
    FeatureLogitsResult,
    GenerationEvent,
    GenerationJob,
    HiddenStatesJob,
    HiddenStatesResult,
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    StructuredOutput,
    TokenizeJob,
    TokenizeResult,
)


class Lane(StrEnum):
    STATE = "state"
    CONTROL = "control"
    WORK = "work"
    STREAM = "stream"


# --------------------------------------------------------------------------- arguments
# Field order is the engine method's parameter order (positional calls map onto it).


class StatusArgs(msgspec.Struct):
    pass


class LoadModelArgs(msgspec.Struct):
    job: LoadModelJob
    timeout_s: float | None = None


class CheckLoadArgs(msgspec.Struct):
    job: LoadModelJob


class UnloadModelArgs(msgspec.Struct):
    timeout_s: float | None = None


class AttachSetArgs(msgspec.Struct):
    specs: list[AttachSpec]
    timeout_s: float | None = None


class DetachArgs(msgspec.Struct):
    sae_id: str | None = None
    layer: int | None = None
    timeout_s: float | None = None


class CheckSaeArgs(msgspec.Struct):
    path: str
    layer: int
    layout: str | None = None


class CancelAllArgs(msgspec.Struct):
    reason: str = "cancel_all"


class BuildGrammarArgs(msgspec.Struct):
    spec: StructuredOutput


class GenerateArgs(msgspec.Struct):
    job: GenerationJob


class EmbedArgs(msgspec.Struct):
    job: EmbedJob
    timeout_s: float | None = None


class ScoreArgs(msgspec.Struct):
    job: ScoreJob
    timeout_s: float | None = None


class HiddenStatesArgs(msgspec.Struct):
    job: HiddenStatesJob
    timeout_s: float | None = None


class TokenizeArgs(msgspec.Struct):
    job: TokenizeJob
    timeout_s: float | None = None


class FeatureLogitsArgs(msgspec.Struct):
    job: FeatureLogitsJob
    timeout_s: float | None = None


class AttributionArgs(msgspec.Struct):
    job: AttributionJob
    timeout_s: float | None = None


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Command:
    name: str
    args: type[msgspec.Struct]
    # the declared result (a msgspec type); for a ``stream`` command, its events
    result: Any
    lane: Lane

    def call(self, engine: Any, args: msgspec.Struct) -> Any:
        """Run the command on an in-process engine."""
        if not isinstance(args, self.args):
            raise TypeError(f"{self.name} takes {self.args.__name__}, not {type(args).__name__}")
        return getattr(engine, self.name)(**msgspec.structs.asdict(args))

    @property
    def parameters(self) -> tuple[str, ...]:
        return self.args.__struct_fields__

    def with_timeout(self, args: msgspec.Struct, default_s: float) -> msgspec.Struct:
        """``args`` with an unset ``timeout_s`` replaced by ``default_s``."""
        if "timeout_s" in self.parameters and args.timeout_s is None:  # type: ignore[attr-defined]
            return msgspec.structs.replace(args, timeout_s=default_s)
        return args

    def request_id(self, args: msgspec.Struct) -> str:
        """The request id of a ``work`` or ``stream`` command (its job's)."""
        return str(args.job.request_id)  # type: ignore[attr-defined]


COMMANDS: Mapping[str, Command] = {
    c.name: c
    for c in (
        Command("status", StatusArgs, EngineStatus, Lane.STATE),
        Command("check_load", CheckLoadArgs, None, Lane.CONTROL),
        Command("load_model", LoadModelArgs, EngineStatus, Lane.CONTROL),
        Command("unload_model", UnloadModelArgs, None, Lane.CONTROL),
        Command("attach_set", AttachSetArgs, list[AttachResult], Lane.CONTROL),
        Command("detach", DetachArgs, list[tuple[str, int]], Lane.CONTROL),
        Command("check_sae", CheckSaeArgs, CompatibilityReport, Lane.CONTROL),
        Command("cancel_all", CancelAllArgs, int, Lane.CONTROL),
        # a structured request's grammar, built before the request takes an admission slot
        Command("build_grammar", BuildGrammarArgs, None, Lane.CONTROL),
        Command("generate", GenerateArgs, GenerationEvent, Lane.STREAM),
        Command("embed", EmbedArgs, EmbedResult, Lane.WORK),
        Command("score", ScoreArgs, ScoreResult, Lane.WORK),
        Command("hidden_states", HiddenStatesArgs, HiddenStatesResult, Lane.WORK),
        Command("tokenize", TokenizeArgs, TokenizeResult, Lane.WORK),
        Command("feature_logits", FeatureLogitsArgs, FeatureLogitsResult, Lane.WORK),
        Command("attribution", AttributionArgs, AttributionResult, Lane.WORK),
    )
}


def command(name: str) -> Command:
    return COMMANDS[name]


def check_implements(cls: type, *, where: str | None = None) -> None:
    """Fail (TypeError) unless ``cls`` has a method per command taking exactly that
    command's arguments (names and order; ``self`` aside)."""
    problems = []
    for cmd in COMMANDS.values():
        method = getattr(cls, cmd.name, None)
        if not callable(method):
            problems.append(f"{cmd.name}: missing")
            continue
        params = [
            p.name
            for p in inspect.signature(method).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if tuple(params) != cmd.parameters:
            problems.append(f"{cmd.name}{tuple(params)}: the table says {cmd.parameters}")
    if problems:
        raise TypeError(
            f"{where or cls.__qualname__} does not implement the engine commands "
            "as declared in gpu_engine.api.commands: " + "; ".join(problems)
        )


__all__ = [
    "COMMANDS",
    "AttachSetArgs",
    "AttributionArgs",
    "BuildGrammarArgs",
    "CancelAllArgs",
    "CheckLoadArgs",
    "CheckSaeArgs",
    "Command",
    "DetachArgs",
    "EmbedArgs",
    "FeatureLogitsArgs",
    "GenerateArgs",
    "HiddenStatesArgs",
    "Lane",
    "LoadModelArgs",
    "ScoreArgs",
    "StatusArgs",
    "TokenizeArgs",
    "UnloadModelArgs",
    "check_implements",
    "command",
]
