"""JSON and JSON-native values of protocol messages: msgspec's own serialisation, typed by
the declared field types, never hand-written.

Decoding applies every declared constraint (``gpu_engine.api.fields``) and each struct's
``__post_init__``; what it refuses comes back as ``InvalidParameter``. A value outside its
declared range names the parameter as building the struct in Python does (``top_p``); a
value of the wrong shape names where it is (``sampling.top_p``).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

from .errors import InvalidParameter
from .fields import decoding, param_name

T = TypeVar("T")


def _enc_hook(value: Any) -> Any:
    # numpy / torch scalars (np.float64 and friends) that slip into a result: their value
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    # anything else in a message is a programming error, named as such
    raise TypeError(f"{type(value).__name__} is not a protocol value")


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)
# msgspec's messages end "- at `$.a.b[0]`", or "- at `key` in `$.a.d`" for a dict key
_WHERE = re.compile(r" - at `(?:(?P<key>key)` in `)?\$\.?(?P<path>[^`]*)`$")
# a value outside a declared constraint (a range, a length, a literal), not a wrong shape
_RANGE = re.compile(
    r"^(Expected `\w+`( of length)? [<>]=? |Expected `str` matching"
    r"|Number out of range|Invalid enum value)"
)
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")


def to_json(obj: Any) -> bytes:
    """JSON bytes of a protocol value (a struct, a list of them, a builtin)."""
    return _ENCODER.encode(obj)


def from_json(data: bytes | str, type_: type[T] | Any) -> T:
    """The typed value ``type_`` decoded from JSON; unknown fields are ignored (a web
    process and an engine of another build can still talk)."""
    try:
        with decoding():
            return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, type_) from None
    except msgspec.DecodeError as exc:
        raise InvalidParameter(f"not valid JSON: {exc}", param="json") from None


def to_builtins(obj: Any) -> Any:
    """A protocol value as JSON-native Python values (dicts, lists, str, numbers)."""
    return msgspec.to_builtins(obj, enc_hook=_enc_hook)


def from_builtins(data: Any, type_: type[T] | Any) -> T:
    """The typed value ``type_`` from JSON-native Python values (``json.loads`` output)."""
    try:
        # not strict: after json.loads, integer dict keys (feature indices) are strings
        with decoding():
            return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, type_) from None


def _invalid(exc: msgspec.ValidationError, type_: Any) -> InvalidParameter:
    message = str(exc)
    match = _WHERE.search(message)
    if match is None:
        return InvalidParameter(message, param="job")
    path = match.group("path")
    param = path.replace("[...]", "") or "job"
    if _RANGE.match(message):
        declared = _declared(type_, "." + path, "key" if match.group("key") else "")
        if declared:
            param = declared
    return InvalidParameter(message, param=param)


def _declared(type_: Any, path: str, last: str) -> str | None:
    """The declared parameter name of the field at ``path`` in ``type_`` (None: not found)."""
    try:
        t = mi.type_info(type_)
    except Exception:  # noqa: BLE001 - a type msgspec cannot describe names no parameter
        return None
    owner: tuple[type, str] | None = None
    part = ""
    for name, index in _STEP.findall(path):
        t = _unwrap(t, name)
        if name:
            if not isinstance(t, mi.StructType):
                return None
            field = next((f for f in t.fields if f.encode_name == name), None)
            if field is None:
                return None
            owner, part, t = (t.cls, field.name), "", field.type
        elif index == "...":
            if not isinstance(t, mi.DictType):
                return None
            part, t = "value", t.value_type
        else:
            if not isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
                return None
            t = getattr(t, "item_type", t)
    if owner is None:
        return None
    return param_name(owner[0], owner[1], last or part)


def _unwrap(t: Any, name: str) -> Any:
    """Through optionals and unions to the member that has field ``name`` (or a container)."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if name:
            return next(
                (m for m in members if isinstance(m, mi.StructType) and any(f.encode_name == name for f in m.fields)),
                members[0] if members else t,
            )
        return next((m for m in members if not isinstance(m, mi.StructType)), members[0] if members else t)
    return t
