"""The /v1 error shape, OpenAI's ``{"error": {"message", "type", "param", "code"}}``: the
exception, its JSON response and its SSE frame (an error frame, then ``[DONE]``). Which
domain or engine error becomes which /v1 code is decided in ``inference.errors``; the
Retry-After rule is the /api envelope's (``core.api.retry_after_value``)."""

from __future__ import annotations

import json
from typing import Any

from django.http import JsonResponse

from core.api import retry_after_value
from core.metrics import mark_error

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    507: "server_error",
}


class OpenAIError(Exception):
    """An error answered on /v1; ``code`` is the documented lower-case code."""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        code: str,
        param: str | None = None,
        type: str | None = None,
        retry_after: int | None = None,
        extra: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.retry_after = retry_after
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})  # response headers beside Retry-After

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        error.update(self.extra)
        return {"error": error}


def openai_error_response(error: OpenAIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status, headers=error.headers)
    retry_after = retry_after_value(error.status, error.retry_after, error.code)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return mark_error(response, error.code)


def openai_error_frame(error: OpenAIError) -> bytes:
    """The SSE frames for an error after the stream started: the error, then [DONE]."""
    return (f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n").encode()
