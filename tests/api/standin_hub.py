"""A stand-in Hugging Face hub on a loopback port: the routes huggingface_hub 2.x really
calls, answered for small repositories built from the offline test assets.

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: repository info
  with ``sha``, ``gated`` and ``siblings`` (sizes when ``?blobs=true``), ``config``,
  ``safetensors``.
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``,
  ``Content-Length``, ``Accept-Ranges``; ``Range: bytes=N-`` answers 206 with
  ``Content-Range`` (how huggingface_hub resumes a dropped transfer).
- Refusals carry the headers huggingface_hub's ``hf_raise_for_status`` maps to its error
  classes: ``X-Error-Code: RepoNotFound`` (404), ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo`` (401 without a token); a wrong token gets 401 with
  ``X-Error-Message: Invalid credentials in Authorization header``.

Faults for the tests: ``outage`` (every answer 503), ``interrupt[path] = "once"`` (the
first GET of that file stops half-way and the connection closes) or ``"fail"`` (the same,
and every later GET of it answers 500), ``delay[path]`` seconds before a file's body.
Every request is recorded (method, path, the Authorization header) so a test can check
what the server sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

VALID_TOKEN = "hf_standin_valid_token_0123456789"


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    gated: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    parameter_count: int | None = None

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.repo_id.encode()).hexdigest()


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    range: str | None


class StandInHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.outage = False
        self.interrupt: dict[str, str] = {}
        self.delay: dict[str, float] = {}
        self.requests: list[Request] = []
        self._interrupted: set[str] = set()
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            owner = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="standin-hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandInHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.outage = False
            self.interrupt.clear()
            self.delay.clear()
            self.requests.clear()
            self._interrupted.clear()

    def add_repo(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo

    def add_directory(
        self, repo_id: str, root: Path, *, prefix: str = "", gated: bool = False, extra: dict[str, bytes] | None = None
    ) -> Repo:
        files = {
            f"{prefix}{p.relative_to(root).as_posix()}": p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
        }
        repo = self.repos.get(repo_id)
        if repo is None:
            config = {}
            if "config.json" in files:
                config = json.loads(files["config.json"])
            repo = self.add_repo(Repo(repo_id, {}, gated=gated, config=config))
        repo.files.update(files)
        repo.files.update(extra or {})
        return repo

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def first_interruption(self, path: str) -> bool:
        with self._lock:
            if path in self._interrupted:
                return False
            self._interrupted.add(path)
            return True

    def was_interrupted(self, path: str) -> bool:
        with self._lock:
            return path in self._interrupted


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")


class _Handler(BaseHTTPRequestHandler):
    owner: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return None

    # --- plumbing ---------------------------------------------------------------------

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

    def _error(
        self, status: int, code: str | None, message: str, head: bool = False, extra: dict[str, str] | None = None
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        headers.update(extra or {})
        self._send(status, b"" if head else json.dumps({"error": message}).encode(), headers, head=head)

    def _token(self) -> str | None:
        header = self.headers.get("Authorization")
        if header and header.lower().startswith("bearer "):
            return header[7:].strip()
        return None

    def _record(self) -> None:
        self.owner.record(
            Request(self.command, self.path, self.headers.get("Authorization"), self.headers.get("Range"))
        )

    # --- routes -----------------------------------------------------------------------

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
        self._record()
        self._resolve(head=True)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._record()
        if self.owner.outage:
            self._error(503, None, "Service Unavailable")
            return
        if self.path.startswith("/api/"):
            self._api()
        else:
            self._resolve(head=False)

    def _api(self) -> None:
        url = urlsplit(self.path)
        match = _API.match(unquote(url.path))
        if match is None:
            self._error(404, None, "Not found")
            return
        repo = self.owner.repos.get(match["repo"])
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return
        rev = match["rev"]
        if rev not in (None, "main", repo.sha):
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        token = self._token()
        if token is not None and token != VALID_TOKEN:
            self._error(401, None, "Invalid credentials in Authorization header")
            return
        blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for name, data in sorted(repo.files.items()):
            entry: dict[str, Any] = {"rfilename": name}
            if blobs:
                entry["size"] = len(data)
                entry["blobId"] = hashlib.sha1(data).hexdigest()
            siblings.append(entry)
        info: dict[str, Any] = {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.sha,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 7,
            "likes": 3,
            "tags": ["test"],
            "pipeline_tag": "text-generation",
            "library_name": "transformers",
            "siblings": siblings,
            "cardData": {"license": "apache-2.0"},
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
        }
        if repo.config:
            info["config"] = {
                k: repo.config[k] for k in ("architectures", "model_type", "auto_map") if k in repo.config
            }
        if repo.parameter_count:
            info["safetensors"] = {"parameters": {"F32": repo.parameter_count}, "total": repo.parameter_count}
        self._json(200, info)

    def _resolve(self, *, head: bool) -> None:
        if self.owner.outage:
            self._error(503, None, "Service Unavailable", head=head)
            return
        match = _RESOLVE.match(unquote(urlsplit(self.path).path))
        if match is None:
            self._error(404, None, "Not found", head=head)
            return
        repo = self.owner.repos.get(match["repo"])
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return
        if match["rev"] not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", "Invalid rev id", head=head)
            return
        commit = {"X-Repo-Commit": repo.sha}
        token = self._token()
        if token is not None and token != VALID_TOKEN:
            self._error(401, None, "Invalid credentials in Authorization header", head=head)
            return
        if repo.gated and token != VALID_TOKEN:
            self._error(401, "GatedRepo", f"Access to model {repo.repo_id} is restricted.", head=head, extra=commit)
            return
        path = match["path"]
        data = repo.files.get(path)
        if data is None:
            self._error(404, "EntryNotFound", "Entry not found", head=head, extra=commit)
            return
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        headers = {**commit, "ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if head:
            self._send(200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
            return
        key = f"{repo.repo_id}/{path}"
        mode = self.owner.interrupt.get(path) or self.owner.interrupt.get(key)
        if mode == "fail" and self.owner.was_interrupted(key):
            self._error(500, None, "Internal Error")
            return
        delay = self.owner.delay.get(path) or self.owner.delay.get(key)
        if delay:
            time.sleep(delay)
        start = 0
        range_header = self.headers.get("Range")
        if range_header:
            found = re.match(r"bytes=(\d+)-(\d*)$", range_header.strip())
            if found:
                start = int(found.group(1))
        body = data[start:]
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        if mode in ("once", "fail") and self.owner.first_interruption(key):
            # Announce the whole body, send half of it, and drop the connection.
            self.send_response(status)
            for k, v in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self._send(status, body, headers)
