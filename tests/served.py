"""A ``manage.py serve`` of a test's own (daphne, embedded engine, its own process) on a
free loopback port, sharing the test database: started, waited for, and stopped.

The live-server tests (tests/api/test_live_server.py and tests/security) start one each,
with the environment their test is about; what is the same for all is here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
# what a served process inherits from the test runner's environment; the rest is the test's
INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")


class Serving(NamedTuple):
    process: subprocess.Popen
    url: str  # http://127.0.0.1:<port>
    port: int
    log: Path  # the server's stdout and stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def database_url() -> str:
    """The test database's URL, for another process to open (PostgreSQL only: the test
    runner's database is not shared otherwise)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.fail(
            "a served process shares the test database with the tests, which needs "
            "PostgreSQL (see README: scripts/test)"
        )
    db = connection.settings_dict
    return (
        f"postgresql://{db['USER']}{':' + db['PASSWORD'] if db['PASSWORD'] else ''}"
        f"@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    )


def answers(url: str, timeout: float = 2) -> bool:
    """A GET of ``url`` is a 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


@contextmanager
def served_process(
    tmp: Path,
    env: dict[str, str],
    *,
    args: Sequence[str] = (),
    ready: str | Callable[[str], bool] = "/api/health",
    timeout_s: float = 90,
) -> Iterator[Serving]:
    """``manage.py serve *args`` on a free loopback port, logging to ``tmp/serve.log``,
    with the runner's PATH and the like, no .env file, the test database, and ``env``.
    Yields once ``ready`` (a path that must answer a GET with 200, or a check given the
    base URL) holds; fails the test with the log if the server exits or is not ready in
    ``timeout_s``. The server is stopped on leaving."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if k in INHERITED}
    full.update({"MILLM_ENV_FILE": "/nonexistent/.env", "DATABASE_URL": database_url(), **env})
    log = tmp / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "manage.py"), "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=full,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    check = ready if callable(ready) else (lambda base: answers(base + ready))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                pytest.fail(f"serve exited with {process.returncode}:\n{log.read_text()}")
            try:
                if check(url):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve was not ready in {timeout_s:.0f} s:\n{log.read_text()}")
            time.sleep(0.2)
        yield Serving(process, url, port, log)
    finally:
        stop(process)
