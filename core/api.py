"""The /api envelope, built in one place: ``{success, data, error: {code, message, details}}``.

Views return ``envelope(data)``; every refusal is an exception that ``exception_handler``
(DRF's EXCEPTION_HANDLER) turns into the same shape: domain errors (``MillmError``),
DRF's own (validation → 422 VALIDATION_ERROR with the field errors in ``details``, parse,
not found, method not allowed) and anything unexpected (500 INTERNAL_ERROR, logged, no
traceback in the body). Every 503 carries ``Retry-After``: the error's own value, else
RETRY_AFTER_FALLBACK_S and a ``retry_after_defaulted`` log line.
"""

from __future__ import annotations

from typing import Any

import structlog
from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.response import Response

from core.errors import MillmError, ValidationFailed, from_engine_error, retry_after_value
from core.metrics import mark_error
from core.middleware import LoopMiddleware
from core.strict_input import strict_errors
from gpu_engine.api.errors import EngineError

log = structlog.get_logger(__name__)

# DRF exception classes -> the contract's codes (others fall back to their default_code).
_DRF_CODES: dict[type[exceptions.APIException], str] = {
    exceptions.NotFound: "NOT_FOUND",
    exceptions.MethodNotAllowed: "METHOD_NOT_ALLOWED",
    exceptions.NotAcceptable: "NOT_ACCEPTABLE",
    exceptions.UnsupportedMediaType: "UNSUPPORTED_MEDIA_TYPE",
    exceptions.NotAuthenticated: "UNAUTHORIZED",
    exceptions.AuthenticationFailed: "UNAUTHORIZED",
    exceptions.PermissionDenied: "FORBIDDEN",
    exceptions.Throttled: "RATE_LIMITED",
}


def envelope(
    data: Any = None, *, status_code: int = status.HTTP_200_OK, headers: dict[str, str] | None = None
) -> Response:
    """A success answer."""
    return Response({"success": True, "data": data, "error": None}, status=status_code, headers=headers)


class JSONBody(dict):
    """A request body parsed from JSON (``JSONBodyParser``): ``validated`` holds it to the
    serializer's fields exactly. Query strings and forms, where every value is text, and
    dicts a view merges from both, stay as lenient as DRF is."""


class JSONBodyParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        return JSONBody(data) if isinstance(data, dict) else data


def validated(serializer_cls: Any, data: Any) -> Any:
    """A view's input through its serializer; a refusal is the 422 VALIDATION_ERROR
    envelope (the exception handler builds it). A JSON body is strict: a field the
    serializer does not declare, or a value of another JSON type ("2" for 2, 1 for true),
    is refused naming the field, never dropped or converted (``core.strict_input``)."""
    if isinstance(data, JSONBody):
        problems = strict_errors(serializer_cls(), data)
        if problems:
            raise exceptions.ValidationError(problems)
    serializer = serializer_cls(data=data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


def body_object(request: Any) -> dict[str, Any]:
    """The request's JSON body, which must be an object (an empty body is ``{}``)."""
    data = request.data if request.data is not None else {}
    if not isinstance(data, dict):
        raise ValidationFailed("The body must be a JSON object", details={"fields": {"body": ["not an object"]}})
    return data


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"success": False, "data": None, "error": {"code": code, "message": message, "details": details or {}}}


def error_response(
    code: str, message: str, *, status_code: int, details: dict[str, Any] | None = None, retry_after: int | None = None
) -> Response:
    response = Response(error_body(code, message, details), status=status_code)
    value = retry_after_value(status_code, retry_after, code)
    if value is not None:
        response["Retry-After"] = str(value)
    return mark_error(response, code)


def error_json(
    code: str, message: str, *, status_code: int, details: dict[str, Any] | None = None, retry_after: int | None = None
):
    """``error_response`` for code outside DRF (middlewares): a plain JsonResponse."""
    from django.http import JsonResponse

    response = JsonResponse(error_body(code, message, details), status=status_code)
    value = retry_after_value(status_code, retry_after, code)
    if value is not None:
        response["Retry-After"] = str(value)
    return mark_error(response, code)


def _field_errors(detail: Any) -> Any:
    """DRF's error detail tree as plain JSON (lists of messages keyed by field)."""
    if isinstance(detail, dict):
        return {str(k): _field_errors(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_field_errors(v) for v in detail]
    return str(detail)


def _validation_message(fields: Any) -> str:
    if isinstance(fields, dict) and fields:
        name, errors = next(iter(fields.items()))
        first = errors[0] if isinstance(errors, list) and errors else errors
        if isinstance(first, dict):
            return f"Invalid request: {name} is invalid"
        if name == "non_field_errors":
            return f"Invalid request: {first}"
        return f"Invalid request: {name}: {first}"
    if isinstance(fields, list) and fields:
        return f"Invalid request: {fields[0]}"
    return "Invalid request"


def _unusable_body(exc: Exception) -> tuple[str, str, int, dict[str, Any]] | None:
    """A body the server cannot take, refused as such (code, message, status, details):
    over Django's DATA_UPLOAD_MAX_MEMORY_SIZE, or JSON nested past the parser's depth."""
    if isinstance(exc, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return ("PAYLOAD_TOO_LARGE", f"The request body is larger than {limit} bytes", 413, {"limit_bytes": limit})
    if isinstance(exc, RecursionError):
        return (
            "VALIDATION_ERROR",
            "Invalid request body: JSON nested too deeply",
            422,
            {"fields": {"body": ["nested too deeply"]}},
        )
    return None


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    """DRF's EXCEPTION_HANDLER for every /api view."""
    if isinstance(exc, EngineError):  # one that no service mapped: the same table
        exc = from_engine_error(exc)
    if isinstance(exc, MillmError):
        return error_response(
            exc.code, exc.message, status_code=exc.status, details=exc.details, retry_after=exc.retry_after
        )
    if (refusal := _unusable_body(exc)) is not None:
        code, message, status_code, details = refusal
        return error_response(code, message, status_code=status_code, details=details)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.ValidationError):
        fields = _field_errors(exc.detail)
        if not isinstance(fields, dict):
            fields = {"non_field_errors": fields}
        return error_response(
            "VALIDATION_ERROR", _validation_message(fields), status_code=422, details={"fields": fields}
        )
    if isinstance(exc, exceptions.ParseError):
        # A body that is not JSON fails validation like a body of the wrong shape does.
        return error_response(
            "VALIDATION_ERROR",
            f"Invalid request body: {exc.detail}",
            status_code=422,
            details={"fields": {"body": [str(exc.detail)]}},
        )
    if isinstance(exc, exceptions.APIException):
        code = _DRF_CODES.get(type(exc), str(exc.default_code).upper())
        retry_after = getattr(exc, "wait", None)
        response = error_response(
            code,
            str(exc.detail) if not isinstance(exc.detail, (dict, list)) else code,
            status_code=exc.status_code,
            retry_after=int(retry_after) + 1 if retry_after is not None else None,
        )
        auth_header = getattr(exc, "auth_header", None)
        if auth_header:
            response["WWW-Authenticate"] = auth_header
        return response
    view = context.get("view")
    log.error(
        "api_unhandled_exception",
        view=type(view).__name__ if view else None,
        error_type=type(exc).__name__,
        exc_info=exc,
    )
    return error_response("INTERNAL_ERROR", "Internal server error; see the server log", status_code=500)


class ApiFallbackMiddleware(LoopMiddleware):
    """/api answers the envelope even where no DRF view ran: an unknown path (Django's
    resolver 404), or an exception escaping a plain Django view (500, logged)."""

    def process_response(self, request, response):
        if not _is_api(request.path) or response.status_code not in (404, 405):
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        code = "NOT_FOUND" if response.status_code == 404 else "METHOD_NOT_ALLOWED"
        message = (
            f"No API route at {request.path}" if response.status_code == 404 else f"Method {request.method} not allowed"
        )
        return error_json(code, message, status_code=response.status_code)

    def process_exception(self, request, exception):
        if not _is_api(request.path):
            return None
        if isinstance(exception, EngineError):
            exception = from_engine_error(exception)
        if isinstance(exception, MillmError):
            return error_json(
                exception.code,
                exception.message,
                status_code=exception.status,
                details=exception.details,
                retry_after=exception.retry_after,
            )
        if (refusal := _unusable_body(exception)) is not None:
            code, message, status_code, details = refusal
            return error_json(code, message, status_code=status_code, details=details)
        log.error("api_unhandled_exception", path=request.path, error_type=type(exception).__name__, exc_info=exception)
        return error_json("INTERNAL_ERROR", "Internal server error; see the server log", status_code=500)


def _is_api(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


class AnyAcceptNegotiation(BaseContentNegotiation):
    """For a route that answers a file or a format of its own choosing: whatever the client
    accepts (``application/octet-stream`` included, which no JSON renderer matches), and
    ``?format=`` left as the route's own parameter (DRF reads it as a renderer override);
    a refusal is still the JSON envelope."""

    def select_parser(self, request, parsers):  # type: ignore[no-untyped-def]
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):  # type: ignore[no-untyped-def]
        return renderers[0], renderers[0].media_type
