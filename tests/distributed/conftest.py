"""Real services for the distributed tests: redis-server and PostgreSQL on 127.0.0.1.

Each test gets its own Redis database number (or key prefix) and the multi-process test a
PostgreSQL database of its own (``millm_dist_<random>``), all removed at the end. Where a
service is missing the tests fail saying what is missing (scripts/services starts both
from the installed binaries) — they are never skipped silently.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import pytest
import redis

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
CELERY = str(Path(sys.executable).with_name("celery"))
REDIS_DBS = range(8, 16)  # databases these tests may take (the suite's default is 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_answers(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_port() -> Iterator[int]:
    """127.0.0.1:6379, or a throwaway redis-server from the installed binary."""
    if _redis_answers(6379):
        yield 6379
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "Redis is not running on 127.0.0.1:6379 and redis-server is not installed "
            "(apt-get install redis-server, or run scripts/test)"
        )
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="millm-redis-")
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _redis_answers(port):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("a throwaway redis-server did not start within 10 s")
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


CLAIM_KEY = "millm-test-claim"
# every key of the database but the claim, in one step
_EMPTY_BUT_CLAIM = """
for _, key in ipairs(redis.call('keys', '*')) do
  if key ~= ARGV[1] then redis.call('del', key) end
end
"""


@pytest.fixture
def redis_url(redis_port: int) -> Iterator[str]:
    """A Redis database of its own (claimed with a marker key), emptied before and flushed
    after. A database nobody claims is free whatever it holds: a killed run, or a write
    that landed after an earlier test's flush, must not take it out of use for good."""
    for db in REDIS_DBS:
        r = redis.Redis(host="127.0.0.1", port=redis_port, db=db)
        if r.set(CLAIM_KEY, os.getpid(), nx=True, ex=900):
            r.eval(_EMPTY_BUT_CLAIM, 0, CLAIM_KEY)
            break
    else:
        pytest.fail(f"no free Redis database among {list(REDIS_DBS)}")
    try:
        yield f"redis://127.0.0.1:{redis_port}/{db}"
    finally:
        r.flushdb()
        r.close()


def _pg_base() -> str:
    return os.environ.get("MILLM_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    """A PostgreSQL database created for one test and dropped after it."""
    import psycopg

    base = _pg_base()
    if not base:
        pytest.fail(
            "the multi-process test needs PostgreSQL (MILLM_TEST_DATABASE_URL is "
            "empty); run scripts/test, which starts one on 127.0.0.1:5432"
        )
    name = f"millm_dist_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(base, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable at {base}: {exc} (scripts/services starts one)")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    parsed = urlparse(base)
    try:
        yield urlunparse(parsed._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Proc:
    """A child process in its own process group (so a kill takes its children too), its
    output in a log file the failure messages quote."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            args, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.stopped_on_purpose = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill9(self) -> None:
        self.stopped_on_purpose = True
        self._signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def terminate(self, timeout_s: float = 30) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit status of the SIGTERM."""
        self.stopped_on_purpose = True
        self._signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def stop(self) -> None:
        if self.alive():
            self.terminate(timeout_s=10)
        self._signal(signal.SIGKILL)  # leftovers of the group
        self._log.close()

    def group_pids(self) -> list[int]:
        """This process and its children (same process group), from /proc."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.popen.pid:  # pgrp
                pids.append(int(stat.parent.name))
        return pids

    def maps_library(self, name: str) -> bool:
        """Whether any process of the group has ``name`` (a shared library) mapped."""
        for pid in self.group_pids():
            try:
                if name in Path(f"/proc/{pid}/maps").read_text():
                    return True
            except OSError:
                continue
        return False

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} ---\n" + "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Children started by a test; every process group is killed at teardown."""
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()


def base_env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        {
            "MILLM_ENV_FILE": "/nonexistent/.env",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            # two cores shared with other test sessions: no thread oversubscription
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env
