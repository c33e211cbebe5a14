"""Strict /api JSON bodies: every field the serializer declares, of its JSON type, and
nothing else. DRF drops unknown keys and reads "2" as 2, 1 as true and 2 as "2"; a client
that misspells a field or sends the wrong type would then get an answer for a request it
did not make (``POST /api/models`` with ``name`` registered the model under its file's
stem). Written here once because DRF has no strict mode; ``core.api.validated`` applies it
to every JSON body."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import serializers

_JSON_TYPE = {
    bool: "a JSON boolean (true or false)",
    int: "a JSON integer",
    float: "a JSON number",
    str: "a JSON string",
    list: "a JSON array",
    dict: "a JSON object",
}


def _expected(field: serializers.Field) -> type | None:
    """The JSON type a field takes, or None where DRF's own check is the only one (files,
    JSON values, choices of mixed types)."""
    if isinstance(field, (serializers.ListSerializer, serializers.ListField)):
        return list
    if isinstance(field, (serializers.Serializer, serializers.DictField, serializers.HStoreField)):
        return dict
    if isinstance(field, serializers.BooleanField):
        return bool
    if isinstance(field, serializers.IntegerField):
        return int
    if isinstance(field, (serializers.FloatField, serializers.DecimalField)):
        return float
    if isinstance(field, serializers.ChoiceField):
        return str if all(isinstance(c, str) for c in field.choices) else None
    if isinstance(field, serializers.CharField):
        return str
    return None


def _is(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _value_errors(field: serializers.Field, value: Any, where: str) -> dict[str, list[str]]:
    if value is None:
        return {}  # allow_null is DRF's to judge
    kind = _expected(field)
    if kind is None:
        return {}
    if not _is(value, kind):
        return {where: [f"must be {_JSON_TYPE[kind]}, not {type(value).__name__} {str(value)[:40]!r}"]}
    errors: dict[str, list[str]] = {}
    if isinstance(field, serializers.ListSerializer):
        for i, item in enumerate(value):
            errors.update(_value_errors(field.child, item, f"{where}[{i}]"))
    elif isinstance(field, serializers.ListField):
        for i, item in enumerate(value):
            errors.update(_value_errors(field.child, item, f"{where}[{i}]"))
    elif isinstance(field, serializers.DictField):
        for key, item in value.items():
            errors.update(_value_errors(field.child, item, f"{where}.{key}"))
    elif isinstance(field, serializers.Serializer):
        errors.update(strict_errors(field, value, prefix=f"{where}."))
    return errors


def strict_errors(
    serializer: serializers.Serializer, data: Mapping[str, Any], *, prefix: str = ""
) -> dict[str, list[str]]:
    """Each unknown or mistyped field of ``data`` (dotted path → messages); empty when the
    body is exactly what ``serializer`` declares."""
    fields = {name: f for name, f in serializer.fields.items() if not f.read_only}
    errors: dict[str, list[str]] = {}
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "no fields"
            errors[f"{prefix}{key}"] = [f"unknown field {key!r}: this body takes {known}"]
    for name, field in fields.items():
        if name in data:
            errors.update(_value_errors(field, data[name], f"{prefix}{name}"))
    return errors
