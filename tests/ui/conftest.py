"""The browser tests' world: ``manage.py serve`` in its own process on a loopback port
(temporary SQLite data dir, the tiny demo assets registered from the shared cache, the
tiny Llama loaded and an SAE attached through /api), a stand-in hub that sends files
slowly enough for a progress bar to be seen moving, and Debian's chromium driven by
Playwright. Screenshots go to ``test-artifacts/ui/``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.api.standin_hub import StandInHub
from tests.fixtures.assets import asset_cache_dir
from tests.ui import documents

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "ui"
SLOW_REPO = "millm-ui/slow-llama"
# Debian's chromium; a machine without internet must not fetch anything in the background
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
VIEWPORT = {"width": 1366, "height": 768}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the stand-in hub, slowed down -------------------------------------------------------


class SlowHub(StandInHub):
    """The /api tests' stand-in hub with file bodies sent at ``rate`` bytes per second.

    huggingface_hub reports a file's bytes once the file is in (it reads in 10 MB chunks),
    so the download's progress moves file by file; the repository gets several files of
    similar size and each takes a visible while."""

    def __init__(self, rate: int) -> None:
        super().__init__()
        base = self._server.RequestHandlerClass

        class Throttled(base):
            def _send(self, status, body=b"", headers=None, *, head=False):
                if head or len(body) < 4096 or self.command != "GET" or "/resolve/" not in self.path:
                    return super()._send(status, body, headers, head=head)
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                piece = 16 * 1024
                for start in range(0, len(body), piece):
                    self.wfile.write(body[start : start + piece])
                    self.wfile.flush()
                    time.sleep(piece / rate)

        self._server.RequestHandlerClass = Throttled


@pytest.fixture(scope="session")
def slow_hub(tiny_assets):
    hub = SlowHub(rate=256 * 1024).start()
    fillers = {f"notes-{i}.json": json.dumps({"notes": "x" * 180_000, "part": i}).encode() for i in range(5)}
    hub.add_directory(SLOW_REPO, tiny_assets.models["tiny-llama"].path, extra=fillers)
    yield hub
    hub.stop()


# --- the server ------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    key: str | None = None
    sae_id: str | None = None

    def call(self, method: str, path: str, body: dict | None = None, *, timeout: float = 30) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        status, out = self.call(method, path, body)
        assert status < 400 and out.get("success", True), (path, status, out)
        return out.get("data", out)

    def wait_for(self, what: str, check, timeout: float = 60, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if self.process.poll() is not None:
                pytest.fail(f"serve exited while waiting for {what}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}:\n{self.log.read_text()[-3000:]}")
            time.sleep(interval)


def _env(root: Path, hub_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")}
    env.update(
        {
            "MILLM_ENV_FILE": "/nonexistent/.env",
            "MILLM_DATA_DIR": str(root),
            "SECRET_KEY": "ui-test-secret-key-0123456789abcdefghijklmnop",
            "MODEL_CACHE_DIR": str(root / "models"),
            "SAE_CACHE_DIR": str(root / "saes"),
            "HF_ENDPOINT": hub_url,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "MILLM_ENGINE_DEVICE": "cpu",
            "MILLM_ENGINE_DTYPE": "float32",
            "LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "1",
            "MAX_PENDING_REQUESTS": "10",
            # the operator's local roots: the tests' own folders and the asset cache
            # (millm_site.test_settings), where the pages register checkpoints and SAEs from
            "LOCAL_MODEL_ROOTS": os.environ.get("LOCAL_MODEL_ROOTS", ""),
        }
    )
    env.update(extra or {})
    return env


def start_server(
    root: Path, hub_url: str, extra: dict[str, str] | None = None, serve: list[str] | None = None
) -> Server:
    """``serve`` is the command that serves (its --host, --port and --no-auto-load
    appended): ``manage.py serve`` unless a test brings its own launcher (a held engine:
    tests/distributed/held_engine.py)."""
    env = _env(root, hub_url, extra)
    manage = [sys.executable, str(REPO / "manage.py")]
    for args in (["migrate", "-v0"], ["create_demo_assets", "--tiny-only", "--output", str(asset_cache_dir())]):
        done = subprocess.run([*manage, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout}\n{done.stderr}"
    port = free_port()
    log = root / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [*(serve or [*manage, "serve"]), "--host", "127.0.0.1", "--port", str(port), "--no-auto-load"],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    server = Server(
        f"http://127.0.0.1:{port}",
        process,
        log,
        key=(extra or {}).get("MILLM_ADMIN_API_KEYS") or (extra or {}).get("MILLM_API_KEYS"),
    )

    def answers() -> bool:
        try:
            return server.call("GET", "/api/health", timeout=2)[0] == 200
        except OSError:
            return False

    server.wait_for("the server to answer", answers, timeout=90)
    return server


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(5)


@pytest.fixture(scope="session")
def server(tiny_assets, slow_hub, tmp_path_factory):
    """The served UI with tiny-llama resident, its layer-1 SAE attached, a cluster and a
    circuit imported, monitoring recording and a few generations in its history. Every
    capture is stored (CAPTURE_INLINE_MAX_BYTES=0), so the captures page has something
    to list."""
    srv = start_server(tmp_path_factory.mktemp("ui-server"), slow_hub.url, {"CAPTURE_INLINE_MAX_BYTES": "0"})
    try:
        models = {m["name"]: m for m in srv.api("GET", "/api/models")["models"]}
        saes = {s["name"]: s for s in srv.api("GET", "/api/saes")["saes"]}
        srv.api("POST", f"/api/models/{models['tiny-llama']['id']}/load")
        srv.wait_for(
            "tiny-llama to load",
            lambda: srv.api("GET", f"/api/models/{models['tiny-llama']['id']}")["status"] == "loaded",
        )
        srv.api("POST", f"/api/saes/{saes['tiny-llama-L1-relu']['id']}/attach", {"layer": 1})
        srv.sae_id = saes["tiny-llama-L1-relu"]["id"]
        for path, doc in (("/api/clusters/import", documents.CLUSTER), ("/api/circuits/import", documents.CIRCUIT)):
            srv.api("POST", path, doc)
        srv.api(
            "POST",
            "/api/profiles",
            {
                "name": "gentle",
                "description": "Two features",
                "sae_id": srv.sae_id,
                "layer": 1,
                "steering": {"1": 6, "2": -4},
            },
        )
        srv.api(
            "POST",
            "/api/monitoring/configure",
            {"enabled": True, "top_k": 5, "positions": "completion", "sae_id": srv.sae_id, "layer": 1},
        )
        for i in range(2):
            status, _ = srv.call(
                "POST",
                "/v1/chat/completions",
                {
                    "model": "tiny-llama",
                    "max_tokens": 8,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": f"warm-up {i}"}],
                },
                timeout=60,
            )
            assert status == 200
        yield srv
    finally:
        stop_server(srv)


# --- the browser ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(
            "chromium is not installed: apt-get install -y chromium "
            "(scripts/test does it; Playwright never downloads a browser here)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


class Console:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on(
            "console",
            lambda m: (
                self.errors.append(f"console.error: {m.text} ({m.location.get('url', '')})")
                if m.type == "error"
                else None
            ),
        )
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def assert_clean(self) -> None:
        assert not self.errors, "\n".join(self.errors)


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.console = Console(page)
    yield page
    context.close()


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def direct_chat(server, message: str, *, model: str = "tiny-llama", **extra) -> str:
    """What ``/v1/chat/completions`` answers ``message`` on ``server`` (greedy, 6 tokens):
    the text a page that sends the same request must show."""
    status, out = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": model,
            "max_tokens": 6,
            "temperature": 0,
            "seed": 0,
            "messages": [{"role": "user", "content": message}],
            **extra,
        },
        timeout=60,
    )
    assert status == 200, out
    return out["choices"][0]["message"]["content"]
