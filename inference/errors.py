"""The one place that decides which /v1 status and code every error a request can meet
gets, and ``openai_view``, the decorator every /v1 route (inference's and the Batch API's)
answers its failures through. The shape itself (``OpenAIError``, its response and SSE frame) is
``core.openai_errors``; every 503 carries ``Retry-After`` (``core.api.retry_after_value``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, TypeVar

import structlog
from django.conf import settings
from django.http import HttpRequest
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel, ValidationError

from core.errors import MillmError, ModelNotLoaded, from_engine_error
from core.openai_errors import (  # noqa: F401 - the /v1 code imports them from here
    OpenAIError,
    openai_error_frame,
    openai_error_response,
)
from gpu_engine.api.errors import EngineError, error_from_dict

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------------------
# Mapping every error a /v1 request can meet onto the OpenAI shape. An engine error
# (gpu_engine.api.errors) first becomes its domain error through core.errors' one engine
# table, as on /api; this table is the only place that decides a domain code's /v1
# status and code.

# domain code -> (status, openai code, Retry-After setting or None)
_DOMAIN: dict[str, tuple[int, str, str | None]] = {
    "VALIDATION_ERROR": (400, "invalid_parameter", None),
    "MODEL_NOT_FOUND": (404, "model_not_found", None),
    "PROFILE_NOT_FOUND": (404, "profile_not_found", None),
    "PROFILE_INCOMPATIBLE": (400, "profile_incompatible", None),
    "SAE_NOT_ATTACHED": (400, "sae_not_attached", None),
    "AMBIGUOUS_SAE": (400, "ambiguous_sae", None),
    "INVALID_FEATURE_INDEX": (400, "invalid_feature_index", None),
    "SAE_ACTIVATIONS_REFUSED": (400, "sae_activations_refused", None),
    "MODEL_LOCKED": (409, "model_locked", None),
    "MODEL_NOT_RESIDENT": (409, "model_not_resident", None),
    "MODEL_NOT_LOADED": (503, "model_not_loaded", "RETRY_AFTER_NOT_LOADED_S"),
    "MODEL_LOADING": (503, "model_loading", "RETRY_AFTER_LOAD_S"),
    "MODEL_BUSY": (503, "model_busy", "RETRY_AFTER_LOAD_S"),
    "QUEUE_FULL": (503, "queue_full", "RETRY_AFTER_QUEUE_DEFAULT_S"),
    "INSUFFICIENT_MEMORY": (503, "insufficient_memory", "RETRY_AFTER_MEMORY_S"),
    "ENGINE_UNAVAILABLE": (503, "engine_unavailable", "RETRY_AFTER_NOT_LOADED_S"),
    "MODEL_LOAD_FAILED": (500, "model_load_failed", None),
    "MODEL_INVALID": (500, "model_load_failed", None),
    "UNSUPPORTED_MODEL": (400, "unsupported_model", None),
    "SAE_INVALID": (400, "sae_format_error", None),
    "CONTEXT_LENGTH_EXCEEDED": (400, "context_length_exceeded", None),
    "GENERATION_FAILED": (500, "generation_failed", None),
    "BACKEND_UNAVAILABLE": (400, "backend_unavailable", None),
    "CAPTURE_TOO_LARGE": (400, "capture_too_large", None),
    "CAPTURE_STORE_FULL": (507, "capture_store_full", None),
    "UNKNOWN_ANALYZER": (400, "unknown_analyzer", None),
    "ANALYZER_CAPTURE_MISSING": (400, "analyzer_capture_missing", None),
    "INVALID_PROBE_FILE": (400, "invalid_probe_file", None),
    "RESPONSE_FORMAT_UNSUPPORTED": (400, "response_format_unsupported", None),
    "SCHEMA_TOO_COMPLEX": (400, "schema_too_complex", None),
    "UNSUPPORTED_QUANTIZATION": (400, "unsupported_quantization", None),
}

# the request field a domain error is about, when the error itself names none (the model
# it asks for, or the profile its steering names)
_PARAM: dict[str, str] = {
    "MODEL_NOT_FOUND": "model",
    "MODEL_NOT_RESIDENT": "model",
    "MODEL_LOCKED": "model",
    "MODEL_LEASED": "model",
    "PROFILE_NOT_FOUND": "profile",
    "PROFILE_INCOMPATIBLE": "profile",
}


def _setting(name: str | None) -> int | None:
    return None if name is None else int(getattr(settings, name))


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """pydantic's ``('messages', 0, 'content')`` → ``messages[0].content``; union and
    validator tags that are not field names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
    return out or None


def openai_error_from_validation(exc: Any) -> OpenAIError:
    """A pydantic ValidationError → 400 invalid_parameter naming the first bad field."""
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    param = _param_path(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return OpenAIError(message, status=400, code="invalid_parameter", param=param)


Model = TypeVar("Model", bound=BaseModel)


def validate_body(schema: type[Model], data: Any) -> Model:
    """``schema.model_validate(data)`` with its failures as /v1 400s: a ValidationError
    names the first bad field (``openai_error_from_validation``); a body nested past
    Python's recursion limit is ``invalid_json``."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise openai_error_from_validation(exc) from None
    except RecursionError:
        raise OpenAIError("The body is nested too deeply", status=400, code="invalid_json") from None


def openai_error_from_exception(exc: BaseException, *, param: str | None = None) -> OpenAIError:
    """The /v1 error for anything raised while serving a request. Unknown exceptions
    become a 500 whose message says nothing of the internals (the log has them)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineError):  # one engine table for every surface (core.errors)
        exc = from_engine_error(exc, no_engine=ModelNotLoaded)  # /v1: 503 model_not_loaded
    if isinstance(exc, MillmError):
        status, code, retry_setting = _DOMAIN.get(
            exc.code, (400 if exc.status == 422 else exc.status, exc.code.lower(), None)
        )
        retry_after = exc.retry_after if exc.retry_after is not None else _setting(retry_setting)
        details = exc.details or {}
        return OpenAIError(
            exc.message,
            status=status,
            code=code,
            param=details.get("param") if isinstance(details.get("param"), str) else _PARAM.get(exc.code, param),
            retry_after=retry_after if status == 503 else None,
        )
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - pydantic is a web requirement
        ValidationError = ()  # type: ignore[assignment]
    if isinstance(exc, ValidationError):
        return openai_error_from_validation(exc)
    log.error("v1_unhandled_error", error_type=type(exc).__name__, exc_info=(type(exc), exc, exc.__traceback__))
    return OpenAIError(
        "The server had an error while processing your request.", status=500, code="internal_error", type="server_error"
    )


def openai_error_event(code: str, message: str, details: dict[str, Any] | None = None) -> OpenAIError:
    """The /v1 error for an engine ``ErrorEvent`` (code, message, details)."""
    return openai_error_from_exception(error_from_dict({"code": code, "message": message, "details": details or {}}))


# the limit on a /v1 request's headers (431 above it)
MAX_HEADER_BYTES = 8192


def openai_view(*methods: str):
    """Make an async view answer every failure in OpenAI's shape: domain and engine
    errors with their codes, validation errors as 400 ``invalid_parameter`` naming the
    field, anything else as a 500 without internals (logged with its traceback)."""

    def decorate(view):
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any):
            try:
                if request.method not in methods:
                    raise OpenAIError(
                        f"Method {request.method} is not allowed here; use {' or '.join(methods)}",
                        status=405,
                        code="method_not_allowed",
                        headers={"Allow": ", ".join(methods)},
                    )  # RFC 9110
                size = sum(len(k) + len(str(v)) for k, v in request.headers.items())
                if size > MAX_HEADER_BYTES:
                    raise OpenAIError(
                        f"Request headers are too large ({size} bytes; the limit is {MAX_HEADER_BYTES})",
                        status=431,
                        code="request_header_fields_too_large",
                    )
                return await view(request, *args, **kwargs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the one exit for /v1 errors
                error = openai_error_from_exception(exc)
                if error.code == "context_length_exceeded" and error.param is None:
                    # the one error about the input as a whole
                    error.param = _context_param(request)
                return openai_error_response(error)

        return wrapper

    return decorate


def _context_param(request: HttpRequest) -> str | None:
    path = request.path
    if path.endswith("/chat/completions"):
        return "messages"
    if path.endswith("/completions"):
        return "prompt"
    if path.endswith("/embeddings"):
        return "input"
    return None
