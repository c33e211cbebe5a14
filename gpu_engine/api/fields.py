"""The value ranges every engine message declares, once, and the small value types the
messages share.

A range is a ``Range``. msgspec reads it as a field's constraint (``Annotated[float,
TOP_P.meta]``), so decoding a message from JSON refuses a value outside it, and the web's
pydantic models read the same bounds (``Field(**TOP_P.bounds())``), so the tiers cannot
drift apart. msgspec checks constraints only when it decodes, never when Python builds a
struct (by design: construction is trusted); ``check_fields`` reads the same declarations
back from msgspec's own type information and applies them at construction, so a job the
web builds in Python is refused as one decoded from Redis is, naming the same parameter.
Checks that depend on several fields stay in each struct's ``__post_init__``.

A struct names its parameters with two class variables: ``_where``, the prefix of every
field's name (``"monitor."``), and ``_names``, the exceptions (``{"prompt_token_ids":
"prompt"}``; a dict's keys and values as ``"features.key"`` / ``"features.value"``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import inspect as mi

from .errors import InvalidParameter

# --------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """An interval of allowed values: ``ge``/``gt`` below, ``le`` above (None: open)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def bounds(self) -> dict[str, float]:
        """The bounds as keyword arguments (pydantic's ``Field``, msgspec's ``Meta``)."""
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}

    @property
    def meta(self) -> msgspec.Meta:
        return msgspec.Meta(**self.bounds())  # type: ignore[call-overload]  # Meta's overloads: one per bound pair


MAX_STEERING_STRENGTH = 200.0
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias lies in [-100, 100]
MAX_MONITOR_TOP_K = 1024
MAX_BATCH_ROWS = 4096
# a seed is any 64-bit integer, signed or not: msgspec cannot declare bounds past int64, so
# SamplingParams checks this one range itself
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

TEMPERATURE = Range(ge=0.0, le=100.0)
TOP_P = Range(gt=0.0, le=1.0)
TOP_K = Range(ge=-1)  # <= 0 disables top-k
REPETITION_PENALTY = Range(gt=0.0, le=10.0)
PENALTY = Range(ge=-2.0, le=2.0)  # presence and frequency penalties (OpenAI's range)
LOGIT_BIAS = Range(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)
TOP_LOGPROBS = Range(ge=0, le=MAX_TOP_LOGPROBS)
STEERING_STRENGTH = Range(ge=-MAX_STEERING_STRENGTH, le=MAX_STEERING_STRENGTH)
CONDITION_THRESHOLD = Range(ge=-1e6, le=1e6)
MONITOR_TOP_K = Range(ge=0, le=MAX_MONITOR_TOP_K)
BATCH_SIZE = Range(ge=1, le=MAX_BATCH_ROWS)
GATHER_MS = Range(ge=0, le=10_000)

# a layer, a feature index, a token id, a row position, a byte count
Index = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]

AttachmentKey = tuple[str, int]
# "interactive": a /v1 request someone waits on; "batch": a Batch API line, admitted only
# when no interactive request waits and only into the rows batch work may hold
PRIORITIES = ("interactive", "batch")


class PositionRange(msgspec.Struct, frozen=True):
    """Residual rows ``start <= position < end`` (``end=None``: to the last row)."""

    _where = "positions."

    start: Index = 0
    end: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.end is not None and self.end < self.start:
            raise InvalidParameter(f"positions.end must be >= {self.start}, got {self.end}", param="positions.end")


# --------------------------------------------------------------------------- checking at construction


def param_name(cls: type, field: str, part: str = "") -> str:
    """The parameter a refusal of ``cls.field`` names (``part``: ``key`` or ``value`` of a dict)."""
    names = getattr(cls, "_names", {})
    return names.get(f"{field}.{part}") or names.get(field) or getattr(cls, "_where", "") + field


def _describe(c: Any) -> str:
    parts = []
    for op, attr in ((">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt")):
        bound = getattr(c, attr, None)
        if bound is not None:
            parts.append(f"{op} {bound}")
    return " and ".join(parts)


def _bounded(c: Any) -> bool:
    return any(getattr(c, a, None) is not None for a in ("ge", "gt", "le", "lt"))


def _inside(value: float, c: Any) -> bool:
    return not (
        (c.ge is not None and not value >= c.ge)
        or (c.gt is not None and not value > c.gt)
        or (c.le is not None and not value <= c.le)
        or (c.lt is not None and not value < c.lt)
    )


Check = Callable[[Any], Any]


def _scalar(t: Any, param: str) -> Check | None:
    """A check of one value against ``t``'s constraints (returning the value to keep), or
    None when ``t`` declares none."""
    if isinstance(t, mi.FloatType) and _bounded(t):

        def check_float(value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidParameter(f"{param} must be a finite number, got {value!r}", param=param)
            if not _inside(value, t):
                raise InvalidParameter(f"{param} must be {_describe(t)}, got {value}", param=param)
            return float(value)

        return check_float
    if isinstance(t, mi.IntType) and _bounded(t):

        def check_int(value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidParameter(f"{param} must be an integer, got {value!r}", param=param)
            if not _inside(value, t):
                raise InvalidParameter(f"{param} must be {_describe(t)}, got {value}", param=param)
            return value

        return check_int
    if isinstance(t, mi.StrType) and (t.min_length or t.pattern):
        pattern = re.compile(t.pattern) if t.pattern else None

        def check_str(value: Any) -> str:
            if not isinstance(value, str) or len(value) < (t.min_length or 0):
                raise InvalidParameter(f"{param} must be a non-empty string, got {value!r}", param=param)
            if pattern is not None and not pattern.search(value):
                raise InvalidParameter(f"{param} must match {t.pattern}, got {value!r}", param=param)
            return value

        return check_str
    if isinstance(t, mi.LiteralType):
        allowed = tuple(t.values)

        def check_literal(value: Any) -> Any:
            if value not in allowed:
                raise InvalidParameter(
                    f"{param} must be one of {', '.join(map(str, allowed))}, got {value!r}", param=param
                )
            return value

        return check_literal
    return None


def _length(t: Any, param: str, what: str) -> Check | None:
    lo, hi = getattr(t, "min_length", None), getattr(t, "max_length", None)
    if lo is None and hi is None:
        return None

    def check_length(value: Any) -> Any:
        if lo is not None and len(value) < lo:
            least = "is empty" if lo == 1 else f"must list at least {lo} {what}"
            raise InvalidParameter(f"{param} {least}", param=param)
        if hi is not None and len(value) > hi:
            raise InvalidParameter(f"{param} allows at most {hi} {what}", param=param)
        return value

    return check_length


def _field_check(cls: type, field: mi.Field) -> Check | None:
    # a union is checked in its one member that is not a struct (a struct checked itself
    # when it was built); None, where allowed, passes
    t, passes = field.type, False
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, (mi.NoneType, mi.StructType))]
        if len(rest) != 1:
            return None
        t, passes = rest[0], True
    param = param_name(cls, field.name)
    check: Check | None
    if isinstance(t, mi.ListType):
        item = _scalar(t.item_type, param)
        length = _length(t, param, "items")
        if item is None and length is None:
            return None

        def check(value: Any) -> Any:
            if not isinstance(value, list):
                raise InvalidParameter(f"{param} must be a list, got {type(value).__name__}", param=param)
            if length is not None:
                length(value)
            # a copy, as every container a struct keeps: the caller's list stays the caller's
            return list(value) if item is None else [item(x) for x in value]
    elif isinstance(t, mi.DictType):
        key = _scalar(t.key_type, param_name(cls, field.name, "key"))
        val = _scalar(t.value_type, param_name(cls, field.name, "value"))
        if key is None and val is None:
            return None

        def check(value: Any) -> Any:
            return {(key(k) if key else k): (val(v) if val else v) for k, v in value.items()}
    else:
        check = _scalar(t, param)
        if check is None:
            return None
    if not passes:
        return check
    inner = check
    return lambda value: value if value is None or isinstance(value, msgspec.Struct) else inner(value)


_CHECKS: dict[type, tuple[tuple[str, Check], ...]] = {}
# set while msgspec decodes, or while values a schema built from the same declarations has
# checked become structs: the constraints have been applied already
_DECODING: ContextVar[bool] = ContextVar("decoding", default=False)


@contextmanager
def decoding() -> Iterator[None]:
    """Structs built inside are being decoded by msgspec (``gpu_engine.api.codec``), which
    has checked their declared constraints: ``check_fields`` leaves them be."""
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


@contextmanager
def prechecked() -> Iterator[None]:
    """Structs built inside hold values already checked against these same declarations
    (the web's /v1 pydantic models, which reuse the ranges through ``Range.bounds()`` or
    the rule that reads them): ``check_fields`` leaves them be, so a range is checked once
    on its way to the engine (docs/engine.md, "A steering spec's shapes")."""
    with decoding():
        yield


def check_fields(obj: msgspec.Struct) -> None:
    """Refuse (``InvalidParameter``) a field outside its declared constraints, and keep
    each value as declared (an integer given for a float field becomes a float)."""
    if _DECODING.get():
        return
    cls = type(obj)
    checks = _CHECKS.get(cls)
    if checks is None:
        info = mi.type_info(cls)
        found = ((f.name, _field_check(cls, f)) for f in info.fields)  # type: ignore[attr-defined]
        checks = _CHECKS[cls] = tuple((name, c) for name, c in found if c is not None)
    for name, check in checks:
        value = getattr(obj, name)
        kept = check(value)
        if kept is not value:
            msgspec.structs.force_setattr(obj, name, kept)
