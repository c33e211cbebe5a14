"""OpenAPI helpers: the envelope around every documented /api answer, the error envelope
on every operation, and the bearer scheme (drf-spectacular postprocessing hook)."""

from __future__ import annotations

from functools import cache
from typing import Any

from drf_spectacular.utils import inline_serializer
from rest_framework import serializers


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
    return inline_serializer(name=name, fields={
        "success": serializers.BooleanField(),
        "data": data,
        "error": ErrorSerializer(allow_null=True),
    })


def enveloped(data: Any = None) -> Any:
    """``{success, data: <data>, error}`` for drf-spectacular's ``responses=``."""
    if data is None or not (isinstance(data, serializers.BaseSerializer) or (
            isinstance(data, type) and issubclass(data, serializers.BaseSerializer))):
        return _envelope_for(None)  # free-form JSON (a field or an OpenApiTypes value)
    if isinstance(data, serializers.BaseSerializer):
        data = type(data)
    return _envelope_for(data)


_ERROR_ENVELOPE = {
    "type": "object",
    "required": ["success", "data", "error"],
    "properties": {
        "success": {"type": "boolean", "enum": [False]},
        "data": {"nullable": True},
        "error": {"type": "object", "required": ["code", "message", "details"],
                  "properties": {"code": {"type": "string"}, "message": {"type": "string"},
                                 "details": {"type": "object", "additionalProperties": {}}}},
    },
}


def add_bearer_auth(result: dict[str, Any], generator: Any, request: Any, public: bool
                    ) -> dict[str, Any]:
    components = result.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http", "scheme": "bearer",
        "description": "Only when the server has MILLM_API_KEYS set."}
    components.setdefault("schemas", {})["ErrorEnvelope"] = _ERROR_ENVELOPE
    open_paths = {"/api/health", "/api/health/ready"}
    for path, operations in result.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            operation["security"] = [] if path in open_paths else [{"bearerAuth": []}, {}]
            operation.setdefault("responses", {}).setdefault("default", {
                "description": "Error envelope (4xx/5xx); every 503 carries Retry-After",
                "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
            })
    return result
