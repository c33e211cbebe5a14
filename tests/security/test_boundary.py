"""The trust boundary of a live ``manage.py serve`` (daphne, its own process, a loopback
port): no header decides where a request goes or skips a key, an inference key cannot
change shared state, bodies are refused before they are read, and with no keys a foreign
web page (CORS, a rebinding Host, a WebSocket Origin) gets nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.served import REPO, served_process

INFERENCE = "alice:inference-key-0123"
ADMIN = "root:admin-key-4567"

pytestmark = pytest.mark.django_db


@dataclass
class Served:
    host: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def raw(
        self, request: bytes, *, then: bytes | None = None, timeout: float = 20
    ) -> tuple[int, dict[str, str], bytes]:
        """Send bytes as they are (headers a client library would not let us forge);
        ``then`` is sent only after the answer has started (proof the body was not
        awaited)."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
            if then is not None:
                try:
                    sock.sendall(then)
                except OSError:
                    pass
            length = headers.get("content-length")
            while length is None or len(rest) < int(length):
                try:
                    chunk = sock.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                rest += chunk
            if headers.get("transfer-encoding", "").lower() == "chunked":
                rest = _unchunk(rest)
            return status, headers, rest

    def request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
        host: str | None = None,
    ) -> tuple[int, dict[str, str], dict]:
        payload = b"" if body is None else json.dumps(body).encode()
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {host or f'127.0.0.1:{self.port}'}",
            "Connection: close",
            f"Content-Length: {len(payload)}",
            "Content-Type: application/json",
        ]
        if key:
            lines.append(f"Authorization: Bearer {key.partition(':')[2]}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        status, got, raw = self.raw(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        try:
            parsed = json.loads(raw) if raw else {}
        except ValueError:
            parsed = {"raw": raw.decode("latin-1")}
        return status, got, parsed


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


@contextmanager
def _serve(tmp: Path, extra: dict[str, str]) -> Iterator[Served]:
    env = {
        "SECRET_KEY": "boundary-test-secret-key-0123456789abcdef",
        "MILLM_DATA_DIR": str(tmp),
        "MILLM_ENGINE_DEVICE": "cpu",
        "LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    with served_process(tmp, env, args=("--no-auto-load",), timeout_s=120) as serving:
        yield Served("127.0.0.1", serving.port, serving.log)


@pytest.fixture(scope="module")
def keyed(django_db_setup, django_db_blocker, tmp_path_factory):
    with _serve(
        tmp_path_factory.mktemp("keyed"), {"MILLM_API_KEYS": INFERENCE, "MILLM_ADMIN_API_KEYS": ADMIN}
    ) as server:
        yield server


@pytest.fixture(scope="module")
def keyless(django_db_setup, django_db_blocker, tmp_path_factory):
    with _serve(tmp_path_factory.mktemp("keyless"), {}) as server:
        yield server


def _model_count(server: Served) -> int:
    status, _, body = server.request("GET", "/api/models", key=ADMIN)
    assert status == 200, body
    return len(body["data"]["models"])


# ------------------------------------------------------------------ headers decide nothing


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/x/api/models"),
        ("GET", "/x/api/health/detailed"),
        ("GET", "/x/v1/models"),
        ("POST", "/x/v1/chat/completions"),
        ("GET", "/x/v1/files"),
    ],
)
def test_a_root_path_header_skips_no_key(keyed, method, path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if method == "POST" else None
    status, _, answer = keyed.request(method, path, body=body, headers={"Daphne-Root-Path": "/x"})
    assert not 200 <= status < 300, (status, answer)
    # and the same without the prefix is the key check's 401, as before
    status, _, answer = keyed.request(method, path[2:], body=body, headers={"Daphne-Root-Path": "/x"})
    assert status == 401, answer


def test_forwarded_headers_from_an_untrusted_peer_change_nothing(keyed):
    status, _, _ = keyed.request(
        "GET",
        "/api/models",
        headers={"X-Forwarded-For": "10.9.8.7", "X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example"},
    )
    assert status == 401


def test_trusted_proxies_alone_are_believed(settings):
    from millm_site.boundary import trusted_scope

    scope = {
        "type": "http",
        "path": "/api/models",
        "scheme": "http",
        "root_path": "/x",
        "client": ("203.0.113.5", 4000),
        "headers": [(b"x-forwarded-for", b"10.0.0.1, 198.51.100.7"), (b"x-forwarded-proto", b"https")],
    }
    settings.MILLM_TRUSTED_PROXIES = ()
    settings.MILLM_ROOT_PATH = ""
    plain = trusted_scope(scope)
    assert (plain["client"], plain["scheme"], plain["root_path"]) == (("203.0.113.5", 4000), "http", "")
    settings.MILLM_TRUSTED_PROXIES = ("203.0.113.0/24",)
    settings.MILLM_ROOT_PATH = "/millm"
    behind = trusted_scope(scope)
    # the rightmost address the trusted proxy did not add is the client
    assert (behind["client"][0], behind["scheme"], behind["root_path"]) == ("198.51.100.7", "https", "/millm")


# ------------------------------------------------------------------ two kinds of keys


def test_an_inference_key_reads_but_cannot_change_shared_state(keyed, tmp_path):
    before = _model_count(keyed)
    status, _, body = keyed.request("GET", "/api/models", key=INFERENCE)
    assert status == 200 and body["success"] is True
    for method, path, payload in [
        ("POST", "/api/models", {"source": "local", "local_path": str(tmp_path)}),
        ("POST", "/api/saes/steering/enable", {}),
        ("POST", "/api/profiles", {"name": "p", "features": []}),
        ("DELETE", "/api/models/1", None),
        ("POST", "/api/models/1/load", {}),
    ]:
        status, _, body = keyed.request(method, path, key=INFERENCE, body=payload)
        assert (status, body["error"]["code"]) == (403, "FORBIDDEN"), (path, body)
        assert "MILLM_ADMIN_API_KEYS" in body["error"]["message"]
    assert _model_count(keyed) == before
    # the admin key reaches the view (a validation error, not a refusal of the key)
    status, _, body = keyed.request("POST", "/api/models", key=ADMIN, body={"bogus": 1})
    assert status not in (401, 403), body


def test_health_says_what_is_protected_never_the_keys(keyed):
    status, _, body = keyed.request("GET", "/api/health")
    assert status == 200
    access = body["data"]["access"]
    assert access["keys_required"] is True
    assert (access["inference_keys"], access["admin_keys"]) == (1, 1)
    text = json.dumps(body)
    for secret in (INFERENCE, ADMIN):
        assert secret.partition(":")[2] not in text


# ------------------------------------------------------------------ bodies


def test_a_declared_huge_body_is_refused_before_it_is_read(keyed):
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\n"
        f"Authorization: Bearer {INFERENCE.partition(':')[2]}\r\n"
        "Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n"
    ).encode()
    status, _, body = keyed.raw(head, then=b"{" * 1000)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_keyless_upload_is_answered_before_its_body_arrives(keyed):
    """A 100 MB upload (under the upload limit) without a key: the 401 comes back while
    the client has sent only the headers, so the server never waited for (nor spooled)
    the body."""
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\n"
        "Content-Length: 100000000\r\n\r\n"
    ).encode()
    status, _, body = keyed.raw(head, timeout=20)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_a_chunked_body_past_the_limit_is_cut(keyed):
    """A chunked body (no Content-Length) is counted as it arrives: exactly the limit, then
    16 bytes more, and the server answers 413 without waiting for the body's end. The
    client sends nothing after the byte that passes the limit, so the server has read all
    it was sent when it closes (no reset racing the answer)."""
    limit = 2621440  # MAX_REQUEST_BODY_BYTES

    def piece(data: bytes) -> bytes:
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    mib = b"x" * (1024 * 1024)
    pieces = [mib] * (limit // len(mib)) + [b"x" * (limit % len(mib)), b"y" * 16]
    request = (
        f"POST /api/models/preview HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\n"
        f"Authorization: Bearer {ADMIN.partition(':')[2]}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode() + b"".join(piece(p) for p in pieces)  # no terminating 0-chunk
    status, _, body = keyed.raw(request)
    assert status == 413, body


# ------------------------------------------------------------------ browsers, no keys


def test_keyless_server_grants_no_foreign_origin(keyless):
    status, headers, _ = keyless.request(
        "OPTIONS", "/v1/files", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"}
    )
    assert "access-control-allow-origin" not in headers
    status, headers, _ = keyless.request("GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_keyless_server_refuses_a_rebound_host(keyless):
    status, _, _ = keyless.request("GET", "/api/models", host="attacker.example")
    assert status == 400
    status, _, body = keyless.request("GET", "/api/models", host=f"localhost:{keyless.port}")
    assert status == 200, body


def test_the_event_socket_checks_origin(keyless):
    ws = keyless.url.replace("http://", "ws://") + "/ws/events"
    with pytest.raises(InvalidStatus):
        with connect(ws, origin="http://evil.example", open_timeout=10) as sock:
            sock.recv(timeout=5)
    with connect(ws, origin=keyless.url, open_timeout=10) as sock:
        sock.send(json.dumps({"type": "ping"}))


def test_cors_star_without_keys_is_refused_at_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update({"MILLM_ENV_FILE": "/nonexistent/.env", "MILLM_DATA_DIR": str(tmp_path), "CORS_ORIGINS": "*"})
    result = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "check_config"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "CORS_ORIGINS" in text and "MILLM_API_KEYS" in text and "Traceback" not in text


# ------------------------------------------------------------------ rebinding and CSRF


def test_a_rebound_host_reaches_no_surface(keyless):
    """The /v1 handler never asked Django for the host: a rebinding page read /v1/files."""
    for method, path in (("GET", "/v1/files"), ("GET", "/v1/models"), ("GET", "/"), ("POST", "/v1/chat/completions")):
        status, _, _ = keyless.request(
            method,
            path,
            host=f"evil.example:{keyless.port}",
            headers={"Origin": f"http://evil.example:{keyless.port}"},
            body={} if method == "POST" else None,
        )
        assert status == 400, path


def test_a_rebound_page_cannot_open_the_socket(keyless):
    ws = keyless.url.replace("http://", "ws://") + "/ws/events"
    with pytest.raises(InvalidStatus):
        with connect(
            ws,
            origin=f"http://evil.example:{keyless.port}",
            open_timeout=10,
            additional_headers={"Host": f"evil.example:{keyless.port}"},
        ) as sock:
            sock.recv(timeout=5)


def test_a_foreign_page_cannot_change_state_with_a_simple_request(keyless):
    """A form post or a no-preflight fetch from another origin is refused before the view:
    nothing is stored."""
    status, _, files = keyless.request("GET", "/v1/files")
    assert status == 200, files
    before = len(files["data"])
    boundary = "millmboundary"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        f'filename="a.jsonl"\r\nContent-Type: application/octet-stream\r\n\r\n'
        "{}\r\n"
        f"--{boundary}--\r\n"
    ).encode()
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{keyless.port}\r\n"
        "Origin: http://evil.example\r\nConnection: close\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(form)}\r\n\r\n"
    ).encode()
    status, _, body = keyless.raw(head + form)
    assert status == 403 and json.loads(body)["error"]["code"] == "cross_origin_refused"
    for path in ("/api/saes/steering/disable", "/api/models/1/load"):
        status, _, body = keyless.request("POST", path, headers={"Sec-Fetch-Site": "cross-site"})
        assert (status, body["error"]["code"]) == (403, "CROSS_ORIGIN_REFUSED"), path
    assert len(keyless.request("GET", "/v1/files")[2]["data"]) == before
    # the server's own pages still may
    status, _, body = keyless.request(
        "POST",
        "/api/saes/steering/disable",
        headers={"Origin": f"http://127.0.0.1:{keyless.port}", "Sec-Fetch-Site": "same-origin"},
    )
    assert status != 403, body


def test_the_admin_takes_no_large_body(keyless):
    head = (
        f"POST /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1:{keyless.port}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        "Content-Length: 50000000\r\n\r\n"
    ).encode()
    status, _, _ = keyless.raw(head)
    assert status == 413


def test_an_inference_key_uploads_nothing_to_an_admin_route(keyed):
    """The 403 comes from the headers: the 100 MB upload is never read."""
    head = (
        f"POST /api/vectors HTTP/1.1\r\nHost: 127.0.0.1:{keyed.port}\r\n"
        f"Authorization: Bearer {INFERENCE.partition(':')[2]}\r\n"
        "Content-Type: multipart/form-data; boundary=x\r\n"
        "Content-Length: 100000000\r\n\r\n"
    ).encode()
    status, _, body = keyed.raw(head)
    assert status == 403 and json.loads(body)["error"]["code"] == "FORBIDDEN"
