"""Access control for /api, /v1 and /ws/events: one rule, one place (docs/security.md).

Two kinds of keys. Inference keys (``MILLM_API_KEYS``) may use /v1 (chat, completions,
embeddings, files, batches), read /api, and manage what they made themselves (captures,
probes, monitoring history). Admin keys (``MILLM_ADMIN_API_KEYS``) may do everything:
registry changes, load and unload, attach, live steering for everyone, documents, and they
see every key's objects. A key entry is ``secret`` or ``label:secret``; the label names the
key in logs and is its owner name (``key:<label>``). With no key of either kind configured
nothing is checked: the caller is the anonymous owner with every right, and the server
binds to loopback and grants no foreign browser origin (millm_site.config).

With keys, every request to /api and /v1 needs ``Authorization: Bearer <key>``; liveness
(/api/health) and readiness (/api/health/ready) stay open so probes work without a secret.
A refusal is 401 (no or wrong key) or 403 (an inference key asking for an admin action) in
the surface's own shape. WebSocket clients authenticate the same way (header), or with
``?api_key=<key>`` because browsers cannot set headers on a WebSocket. Every decision reads
the routed path (``path_info``): the ASGI application fixes ``root_path`` from the
configuration, never from a client's header (millm_site.asgi). The Django admin keeps its
own session login.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from core.errors import Forbidden
from core.middleware import LoopMiddleware
from core.openai_errors import OpenAIError, openai_error_response

log = structlog.get_logger(__name__)

OPEN_PATHS = frozenset({"/api/health", "/api/health/", "/api/health/ready", "/api/health/ready/"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# /api calls that change state but only the caller's own objects: inference keys may make
# them (the views check ownership). Every other non-GET /api call needs an admin key.
INFERENCE_WRITES: tuple[tuple[frozenset[str], re.Pattern[str]], ...] = tuple(
    (frozenset(methods), re.compile(pattern))
    for methods, pattern in (
        ({"DELETE"}, r"^/api/captures/[^/]+/?$"),
        ({"POST"}, r"^/api/captures/[^/]+/analyze/?$"),
        ({"POST"}, r"^/api/probes/import/?$"),
        ({"POST"}, r"^/api/probes/score/?$"),
        ({"DELETE"}, r"^/api/probes/[^/]+/?$"),
        ({"POST"}, r"^/api/probes/[^/]+/validate/?$"),
        ({"DELETE"}, r"^/api/monitoring/history/?$"),
        ({"POST"}, r"^/api/probes/?$"),
        ({"POST"}, r"^/api/monitoring/statistics/top/?$"),
        # a dashboard run over the sample or the caller's own file; cancel only one's own
        ({"POST"}, r"^/api/saes/[^/]+/dashboards/?$"),
        ({"POST"}, r"^/api/dashboards/[^/]+/cancel/?$"),
        # experiments (sweeps, calibrations, fidelity runs, attribution) are the caller's
        # own; cancel only one's own; a calibration saved into a profile needs an admin key
        ({"POST"}, r"^/api/experiments/(sweep|calibrate|fidelity|attribution)/?$"),
        ({"POST"}, r"^/api/experiments/[^/]+/cancel/?$"),
        # live steering: an inference key changes only its own scope (steering.apis._scope)
        ({"POST", "DELETE"}, r"^/api/saes/steering/?$"),
        ({"POST"}, r"^/api/saes/steering/(batch|enable|disable)/?$"),
        ({"DELETE"}, r"^/api/saes/steering/\d+/?$"),
    )
)


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``owner`` names what they make (``anonymous`` with keys off,
    ``key:<label>`` with keys), ``label`` goes in logs, ``admin`` holds every right."""

    owner: str
    label: str
    admin: bool


ANONYMOUS = Principal(owner="anonymous", label="anonymous", admin=True)
# the ASGI scope key where millm_site.boundary keeps the caller it identified (a Principal
# or None), so the middleware does not compare the key against every key again
CALLER = "millm.caller"


@dataclass(frozen=True)
class _Key:
    label: str
    secret: bytes


def parse_key(entry: str) -> _Key:
    """``label:secret`` or a bare ``secret`` (labelled by a short hash of itself)."""
    entry = entry.strip()
    label, sep, secret = entry.partition(":")
    if sep and label and secret and re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", label):
        return _Key(label, secret.encode())
    digest = hashlib.sha256(entry.encode()).hexdigest()[:10]
    return _Key(f"key-{digest}", entry.encode())


def keys_enabled() -> bool:
    return bool(settings.MILLM_API_KEYS or getattr(settings, "MILLM_ADMIN_API_KEYS", ()))


@lru_cache(maxsize=8)
def _principals(
    admin_entries: tuple[str, ...], inference_entries: tuple[str, ...]
) -> tuple[tuple[bytes, Principal], ...]:
    """Every configured key with the principal it stands for, parsed once per setting."""
    out = []
    for admin, entries in ((True, admin_entries), (False, inference_entries)):
        for entry in entries:
            key = parse_key(entry)
            out.append((key.secret, Principal(owner=f"key:{key.label}", label=key.label, admin=admin)))
    return tuple(out)


def identify(presented: str | None) -> Principal | None:
    """The principal a presented key stands for, or None. Compares against every key, so
    the time taken says nothing about which one is close."""
    if not presented:
        return None
    candidate = presented.encode()
    found: Principal | None = None
    for secret, who in _principals(
        tuple(getattr(settings, "MILLM_ADMIN_API_KEYS", ())), tuple(settings.MILLM_API_KEYS)
    ):
        if hmac.compare_digest(candidate, secret) and found is None:
            found = who
    return found


def principal_for(owner: str) -> Principal | None:
    """The configured key whose objects ``owner`` (``key:<label>``) names, or None (keys
    off, or no such key any more): a Batch API batch's quota is its key's."""
    for _, who in _principals(tuple(getattr(settings, "MILLM_ADMIN_API_KEYS", ())), tuple(settings.MILLM_API_KEYS)):
        if who.owner == owner:
            return who
    return None


def key_is_valid(presented: str | None) -> bool:
    return identify(presented) is not None


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


def needs_admin(method: str, path: str) -> bool:
    """Whether an /api call is an admin action (any change of shared state)."""
    if method in SAFE_METHODS or not (path == "/api" or path.startswith("/api/")):
        return False
    return not any(method in methods and pattern.match(path) for methods, pattern in INFERENCE_WRITES)


def principal(request: Any) -> Principal:
    """The caller of a request (set by ApiKeyMiddleware; anonymous with keys off)."""
    found = getattr(request, "millm_principal", None)
    if found is not None:
        return found
    return ANONYMOUS if not keys_enabled() else Principal("unknown", "unknown", False)


def require_admin(request: Any, what: str) -> None:
    """Raise a 403 in the surface's shape unless the caller holds an admin key."""
    if not principal(request).admin:
        raise _forbidden_error(request_path(request), what)


def request_path(request: Any) -> str:
    return getattr(request, "path_info", None) or getattr(request, "path", "") or ""


def _forbidden_message(what: str) -> str:
    return f"{what} needs an admin key (MILLM_ADMIN_API_KEYS); this key is an inference key (MILLM_API_KEYS)"


def _forbidden_error(path: str, what: str) -> Exception:
    message = _forbidden_message(what)
    if path.startswith("/v1"):
        return OpenAIError(message, status=403, code="insufficient_permissions", type="permission_error")

    return Forbidden(message)


def _refusal(path: str, status: int, reason: str) -> HttpResponse:
    if path.startswith("/v1"):
        code, kind = (
            ("invalid_api_key", "authentication_error")
            if status == 401
            else ("insufficient_permissions", "permission_error")
        )
        response = openai_error_response(OpenAIError(reason, status=status, code=code, type=kind))
    else:
        from core.api import error_json

        response = error_json("UNAUTHORIZED" if status == 401 else "FORBIDDEN", reason, status_code=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="miLLM"'
    return response


class ApiKeyMiddleware(LoopMiddleware):
    """Runs on the event loop (LoopMiddleware): no thread hop before a /v1 stream."""

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        path = request.path_info
        if not keys_enabled():
            request.millm_principal = ANONYMOUS
            return None
        if not protected(path) or request.method == "OPTIONS":
            return None
        token = bearer_token(request.headers.get("Authorization"))
        if token is None:
            return _refusal(path, 401, "Missing API key: send Authorization: Bearer <key>")
        scope = getattr(request, "scope", None) or {}
        # identified once at the ASGI door (millm_site.boundary.caller), else here
        who = scope[CALLER] if CALLER in scope else identify(token)
        if who is None:
            log.info("api_key_rejected", path=path)
            return _refusal(path, 401, "Invalid API key")
        request.millm_principal = who
        if not who.admin and needs_admin(request.method, path):
            log.info("api_key_forbidden", path=path, method=request.method, key=who.label)
            return _refusal(path, 403, _forbidden_message(f"{request.method} {path}"))
        return None


def _origin_allowed(origin: str, host: str | None) -> bool:
    """A browser's Origin may open the WebSocket when it is one of CORS_ORIGINS or this
    server itself; a client that sends no Origin is not a browser page."""
    if not origin:
        return True
    allowed = getattr(settings, "CORS_ALLOWED_ORIGINS", None) or ()
    if origin.rstrip("/") in {o.rstrip("/") for o in allowed}:
        return True
    if getattr(settings, "CORS_ALLOW_ALL_ORIGINS", False):
        return True
    # the page's own server: its host:port is the Host it sent, and that Host names this
    # server (ALLOWED_HOSTS) — a rebinding page sends its own name as both, and is refused
    from django.http.request import split_domain_port, validate_host

    netloc = urlsplit(origin).netloc
    domain, _ = split_domain_port(host or "")
    return (
        bool(host) and netloc.lower() == host.lower() and bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)
    )


class WebSocketApiKeyMiddleware:
    """ASGI middleware in front of the WebSocket router: refuses the handshake when a
    browser page of a foreign origin opens it (close code 4403), and when keys are
    configured and the client brought none that matches (4401)."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.inner(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        code = None
        if not _origin_allowed(headers.get("origin", ""), headers.get("host")):
            log.info("websocket_origin_refused", origin=headers.get("origin"))
            code = 4403
        elif keys_enabled():
            token = bearer_token(headers.get("authorization"))
            if token is None:
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                token = (query.get("api_key") or [None])[0]
            who = identify(token)
            if who is None:
                code = 4401
            else:
                scope = {**scope, "millm_principal": who}
        else:
            scope = {**scope, "millm_principal": ANONYMOUS}
        if code is not None:
            message = await receive()
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.close", "code": code})
            return None
        return await self.inner(scope, receive, send)
