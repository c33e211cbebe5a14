"""The /api envelope in the OpenAPI schema: ``enveloped(<serializer>)`` for an operation's
``responses=`` (the site's postprocessing hooks live in ``millm_site.schema``)."""

from __future__ import annotations

from functools import cache
from typing import Any

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers

# The largest feature index any input may name (the database's integer column: a bigger
# one would reach PostgreSQL as "integer out of range", a 500), and the largest layer.
MAX_INDEX = 2**31 - 1
MAX_LAYER = 10_000


class ErrorSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable, machine-readable (MODEL_NOT_FOUND, …)")
    message = serializers.CharField()
    details = serializers.DictField(child=serializers.JSONField())


@cache
def _envelope_for(data_cls: type | None) -> Any:
    if data_cls is None:
        name, data = "AnyEnvelope", serializers.JSONField(allow_null=True)
    else:
        base = data_cls.__name__.removesuffix("Serializer").removesuffix("Output")
        name, data = f"{base}Envelope", data_cls()
    return inline_serializer(
        name=name,
        fields={
            "success": serializers.BooleanField(),
            "data": data,
            "error": ErrorSerializer(allow_null=True),
        },
    )


def enveloped(data: Any = None) -> Any:
    """``{success, data: <data>, error}`` for drf-spectacular's ``responses=``."""
    if data is None or not (
        isinstance(data, serializers.BaseSerializer)
        or (isinstance(data, type) and issubclass(data, serializers.BaseSerializer))
    ):
        return _envelope_for(None)  # free-form JSON (a field or an OpenApiTypes value)
    if isinstance(data, serializers.BaseSerializer):
        data = type(data)
    return _envelope_for(data)
