"""The one place that builds OpenAI-shaped errors for ``/v1``:
``{"error": {"message", "type", "param", "code"}}`` — also inside an SSE stream, where the
same object is sent as a data frame followed by ``[DONE]``.

Every 503 carries ``Retry-After``; a 503 that reaches here without one gets
RETRY_AFTER_FALLBACK_S and a ``retry_after_defaulted`` log line, so a missing value is
visible instead of silent.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from django.conf import settings
from django.http import JsonResponse

log = structlog.get_logger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable", 507: "server_error"}


class OpenAIError(Exception):
    """An error answered on /v1; ``code`` is the documented lower-case code."""

    def __init__(self, message: str, *, status: int, code: str, param: str | None = None,
                 type: str | None = None, retry_after: int | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param,
                 "code": self.code}
        error.update(self.extra)
        return {"error": error}


def _retry_after(status: int, retry_after: int | None, code: str) -> int | None:
    if status != 503:
        return retry_after
    if retry_after is None:
        log.warning("retry_after_defaulted", code=code)
        return int(settings.RETRY_AFTER_FALLBACK_S)
    return int(retry_after)


def openai_error_response(error: OpenAIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    retry_after = _retry_after(error.status, error.retry_after, error.code)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response


def openai_error_frame(error: OpenAIError) -> bytes:
    """The SSE frames for an error after the stream started: the error, then [DONE]."""
    return (f"data: {json.dumps(error.body())}\n\n" "data: [DONE]\n\n").encode()
