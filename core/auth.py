"""Access control for /api, /v1 and /ws/events: one rule, one place.

With MILLM_API_KEYS set every request to /api and /v1 needs ``Authorization: Bearer
<key>``; liveness (/api/health) and readiness (/api/health/ready) stay open so probes work
without a secret. A refusal is 401 in the surface's own shape: the /api envelope, or
OpenAI's error object on /v1. WebSocket clients authenticate the same way (header), or
with ``?api_key=<key>`` because browsers cannot set headers on a WebSocket. Without keys
nothing is checked; the server then binds to 127.0.0.1 unless HOST says otherwise.
The admin keeps Django's own session login.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qs

import structlog
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from core.middleware import LoopMiddleware

log = structlog.get_logger(__name__)

OPEN_PATHS = frozenset({"/api/health", "/api/health/", "/api/health/ready",
                        "/api/health/ready/"})


def key_is_valid(presented: str | None, keys: Iterable[str] | None = None) -> bool:
    if not presented:
        return False
    candidate = presented.encode()
    # compare_digest against every key, so timing says nothing about which one is close
    matched = False
    for key in (settings.MILLM_API_KEYS if keys is None else keys):
        matched |= hmac.compare_digest(candidate, key.encode())
    return matched


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def protected(path: str) -> bool:
    if path in OPEN_PATHS:
        return False
    return path.startswith(("/api/", "/v1/")) or path in ("/api", "/v1")


def _unauthorized(path: str, reason: str) -> HttpResponse:
    if path.startswith("/v1"):
        from core.openai_errors import OpenAIError, openai_error_response

        response = openai_error_response(OpenAIError(
            reason, status=401, code="invalid_api_key", type="authentication_error"))
    else:
        from core.api import error_json

        response = error_json("UNAUTHORIZED", reason, status_code=401)
    response["WWW-Authenticate"] = 'Bearer realm="miLLM"'
    return response


class ApiKeyMiddleware(LoopMiddleware):
    """Runs on the event loop (LoopMiddleware): no thread hop before a /v1 stream."""

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        if settings.MILLM_API_KEYS and protected(request.path) and request.method != "OPTIONS":
            token = bearer_token(request.headers.get("Authorization"))
            if token is None:
                return _unauthorized(request.path,
                                     "Missing API key: send Authorization: Bearer <key>")
            if not key_is_valid(token):
                log.info("api_key_rejected", path=request.path)
                return _unauthorized(request.path, "Invalid API key")
        return None


class WebSocketApiKeyMiddleware:
    """ASGI middleware in front of the WebSocket router: refuses the handshake (close
    code 4401) when keys are configured and the client brought none that matches."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and settings.MILLM_API_KEYS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope.get("headers", [])}
            token = bearer_token(headers.get("authorization"))
            if token is None:
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                token = (query.get("api_key") or [None])[0]
            if not key_is_valid(token):
                message = await receive()
                if message["type"] == "websocket.connect":
                    await send({"type": "websocket.close", "code": 4401})
                return None
        return await self.inner(scope, receive, send)
