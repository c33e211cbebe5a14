"""Raw HTTP for the /v1 tests (what the official client would hide): exact status,
headers and SSE frames."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


@dataclass
class Raw:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def frames(self) -> list[str]:
        """The ``data:`` payloads of an SSE body, in order."""
        return [line[len("data: ") :] for line in self.body.decode().split("\n") if line.startswith("data: ")]

    def events(self) -> list[Any]:
        return [f if f == "[DONE]" else json.loads(f) for f in self.frames()]


def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> Raw:
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    try:
        conn.request(method, url.path.rstrip("/") + path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return Raw(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def assert_openai_error(resp: Raw, status: int, code: str, param: str | None = "*") -> dict:
    assert resp.status == status, (resp.status, resp.body[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param != "*":
        assert error["param"] == param, error
    if status == 503:
        assert int(resp.headers["retry-after"]) >= 1
    return error


def open_stream(base_url: str, path: str, body: Any) -> tuple[socket.socket, bytes]:
    """Send a streaming request on a bare socket and return it with the first bytes of
    the response, so a test can hang up mid-stream."""
    url = urlparse(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    while b"data: " not in received or received.count(b"\n\n") < 3:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return sock, received


def wait_for_status(fetch: Callable[[], Any], statuses: tuple[str, ...], timeout_s: float, every_s: float) -> Any:
    """Poll ``fetch()`` (a retrieve through the official client) every ``every_s`` until
    the object's ``status`` is one of ``statuses``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fetch()
        if got.status in statuses:
            return got
        assert time.monotonic() < deadline, f"still {got.status} after {timeout_s} s: {got}"
        time.sleep(every_s)
