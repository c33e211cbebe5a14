"""What a client's bytes may decide before Django sees the request (docs/security.md).

- ``root_path`` comes from ROOT_PATH, never from a client's ``Daphne-Root-Path`` header,
  and every path decision (routing to the /v1 handler, the key check) reads the routed
  path: the request path less that configured prefix.
- ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are believed only from a peer listed in
  TRUSTED_PROXIES; from anyone else the client address and scheme are the connection's.
- A body is refused from its ``Content-Length`` before a byte of it is read when it is
  over the surface's limit (413), and counted as it arrives when it has none; the body of
  a request that carries no valid key for a protected path is never read at all (the
  middleware answers 401 from the headers), so nothing is spooled to disk for it.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from core.auth import CALLER, Principal, bearer_token, identify, keys_enabled, needs_admin, protected

# multipart uploads: their views apply each file's exact limit; this bounds what is read
UPLOAD_PATHS = ("/v1/files", "/api/probes/import", "/api/vectors")
MULTIPART_SLACK_BYTES = 64 * 1024
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
HEADERS = "millm.headers"  # scope keys of what is worked out once per request


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    """The request's headers by lower-case name, decoded once per request (kept in the
    scope: every check below reads them, on the path each /v1 token's request takes)."""
    cached = scope.get(HEADERS)
    if cached is None:
        cached = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        scope[HEADERS] = cached
    return cached


def caller(scope: dict[str, Any]) -> Principal | None:
    """Who the request's bearer key names (None: no valid key), looked up once per request
    and kept in the scope, where ``core.auth.ApiKeyMiddleware`` reads it again."""
    if CALLER not in scope:
        scope[CALLER] = identify(bearer_token(_headers(scope).get("authorization")))
    return scope[CALLER]


def _trusted_peer(scope: dict[str, Any]) -> bool:
    client = scope.get("client")
    if not client or not settings.MILLM_TRUSTED_PROXIES:
        return False
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    return any(address in ipaddress.ip_network(net, strict=False) for net in settings.MILLM_TRUSTED_PROXIES)


def trusted_scope(scope: dict[str, Any]) -> dict[str, Any]:
    """The scope with root_path from the configuration and the forwarded client address
    and scheme taken only from a trusted proxy (the rightmost address it did not add)."""
    scope = {**scope, "root_path": settings.MILLM_ROOT_PATH}
    if _trusted_peer(scope):
        headers = _headers(scope)
        chain = [x.strip() for x in headers.get("x-forwarded-for", "").split(",") if x.strip()]
        nets = [ipaddress.ip_network(n, strict=False) for n in settings.MILLM_TRUSTED_PROXIES]
        for hop in reversed(chain):
            try:
                address = ipaddress.ip_address(hop)
            except ValueError:
                break
            if not any(address in net for net in nets):
                scope["client"] = (hop, 0)
                break
        proto = headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
        if proto in ("http", "https"):
            scope["scheme"] = proto if scope["type"] == "http" else ("wss" if proto == "https" else "ws")
    return scope


def routed_path(scope: dict[str, Any]) -> str:
    """The path Django routes (path_info): the request path less ROOT_PATH."""
    path = scope.get("path", "") or ""
    root = scope.get("root_path", "") or ""
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def body_limit(scope: dict[str, Any], path: str) -> int:
    if path.startswith("/api/probes/import"):
        from monitoring.probes import MAX_FILE_BYTES

        return int(MAX_FILE_BYTES) + MULTIPART_SLACK_BYTES
    if path.startswith(UPLOAD_PATHS):
        return int(settings.BATCH_MAX_FILE_BYTES) + MULTIPART_SLACK_BYTES
    if path.startswith("/api/saes/") and path.rstrip("/").endswith("/explanations/import"):
        from registry.explanations import MAX_IMPORT_BYTES

        return int(MAX_IMPORT_BYTES) + MULTIPART_SLACK_BYTES
    return int(settings.MAX_REQUEST_BODY_BYTES)


def host_allowed(scope: dict[str, Any]) -> bool:
    """The Host header names this server (ALLOWED_HOSTS): a page that rebinds its own DNS
    name to this address sends its own name and is refused, on every surface (the /v1
    handler never asks Django for the host)."""
    from django.http.request import split_domain_port, validate_host

    domain, _ = split_domain_port(_headers(scope).get("host", ""))
    return bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)


def own_origin(scope: dict[str, Any]) -> bool:
    """The browser page that sent this request is one this server trusts: its own (the
    Origin's host:port is the validated Host), or one of CORS_ORIGINS."""
    headers = _headers(scope)
    origin = headers.get("origin", "").strip().rstrip("/")
    if not origin:
        # no Origin: not a page's cross-site fetch, unless the browser says it is one
        return headers.get("sec-fetch-site", "").lower() != "cross-site"
    if getattr(settings, "CORS_ALLOW_ALL_ORIGINS", False):
        return True
    allowed = {o.rstrip("/") for o in getattr(settings, "CORS_ALLOWED_ORIGINS", ()) or ()}
    if origin in allowed:
        return True
    netloc = urlsplit(origin).netloc.lower()
    return bool(netloc) and netloc == headers.get("host", "").lower() and host_allowed(scope)


def browser_refusal(scope: dict[str, Any], path: str) -> tuple[int, bytes] | None:
    """400 for a Host this server is not; 403 for a state-changing request a foreign web
    page sent (a form post or a "simple" fetch needs no CORS preflight, so CORS alone does
    not stop it)."""
    if not host_allowed(scope):
        return 400, _surface_error(
            path, 400, "INVALID_HOST", "The Host header does not name this server (ALLOWED_HOSTS)", {}
        )
    if scope.get("method", "GET") not in SAFE_METHODS and not own_origin(scope):
        return 403, _surface_error(
            path,
            403,
            "CROSS_ORIGIN_REFUSED",
            "A page of another origin may not change this server's state (CORS_ORIGINS)",
            {},
        )
    return None


def _surface_error(path: str, status: int, code: str, message: str, details: dict[str, Any]) -> bytes:
    if path.startswith("/v1"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code.lower()}}
    else:
        body = {"success": False, "data": None, "error": {"code": code, "message": message, "details": details}}
    return json.dumps(body).encode()


def body_refusal(scope: dict[str, Any], path: str) -> tuple[int, bytes] | None:
    """413 from Content-Length alone, before the body is read."""
    declared = _headers(scope).get("content-length")
    if declared is None:
        return None
    limit = body_limit(scope, path)
    try:
        size = int(declared)
    except ValueError:
        return 400, _surface_error(path, 400, "INVALID_REQUEST", "Content-Length is not a number", {})
    if size > limit:
        return 413, too_large(path, limit)
    return None


def unauthorized_body(path: str) -> bytes:
    """The key check's 401 body, in the surface's shape (core.auth answers the same)."""
    if path.startswith("/v1"):
        return json.dumps(
            {
                "error": {
                    "message": "Missing or invalid API key: send Authorization: Bearer <key>",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
    return _surface_error(path, 401, "UNAUTHORIZED", "Missing or invalid API key: send Authorization: Bearer <key>", {})


def too_large(path: str, limit: int) -> bytes:
    # /v1's code is request_too_large (as inference.views answers it), /api's the envelope's
    return _surface_error(
        path,
        413,
        "REQUEST_TOO_LARGE" if path.startswith("/v1") else "PAYLOAD_TOO_LARGE",
        f"The request body is larger than {limit} bytes",
        {"limit_bytes": limit},
    )


async def send_refusal(send, status: int, body: bytes) -> None:  # noqa: ANN001
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def unauthenticated(scope: dict[str, Any], path: str) -> bool:
    """A protected request with no valid key, or an inference key asking for an admin
    action: its body is never read (the middleware answers 401 or 403)."""
    if not keys_enabled() or not protected(path) or scope.get("method") == "OPTIONS":
        return False
    who = caller(scope)
    if who is None:
        return True
    return not who.admin and needs_admin(scope.get("method", "GET"), path)


def key_refusal(scope: dict[str, Any], path: str) -> tuple[int, bytes, list] | None:
    """The key check from the headers alone (what the middleware would answer)."""
    if not unauthenticated(scope, path):
        return None
    who = caller(scope)
    if who is None:
        return 401, unauthorized_body(path), [(b"WWW-Authenticate", b'Bearer realm="miLLM"')]
    message = (
        f"{scope.get('method')} {path} needs an admin key (MILLM_ADMIN_API_KEYS); "
        "this key is an inference key (MILLM_API_KEYS)"
    )
    if path.startswith("/v1"):
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "permission_error",
                    "param": None,
                    "code": "insufficient_permissions",
                }
            }
        )
        return 403, body.encode(), []
    return 403, _surface_error(path, 403, "FORBIDDEN", message, {}), []


def header_refusal(scope: dict[str, Any], path: str, length: int | None) -> tuple[int, bytes, list] | None:
    """Everything decided from the request line and headers, before a body is read:
    Host, a foreign page's state change, the declared size, and (for a request with a
    body) the key. ``length`` is the declared Content-Length (None: chunked)."""
    refusal = browser_refusal(scope, path)
    if refusal is not None:
        return (*refusal, [])
    limit = body_limit(scope, path)
    if length is not None and length > limit:
        return 413, too_large(path, limit), []
    if length is None or length > 0:
        return key_refusal(scope, path)
    return None


async def _empty_body() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def guarded(app, scope, receive, send, path: str) -> None:  # noqa: ANN001
    """Run ``app`` with the body counted against the surface's limit: past it the app
    sees the client go away and the client gets 413."""
    if unauthenticated(scope, path):
        await app(scope, _empty_body, send)
        return
    limit = body_limit(scope, path)
    state = {"read": 0, "over": False, "started": False}

    async def counted_receive() -> dict[str, Any]:
        if state["over"]:
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.request":
            state["read"] += len(message.get("body", b""))
            if state["read"] > limit:
                state["over"] = True
                return {"type": "http.disconnect"}
        return message

    async def watched_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            state["started"] = True
        await send(message)

    await app(scope, counted_receive, watched_send)
    if state["over"] and not state["started"]:
        await send_refusal(send, 413, too_large(path, limit))
