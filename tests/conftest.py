"""Shared fixtures: the offline tiny assets (built once per session) and helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures.assets", "tests.fixtures.llamacpp"]

REPO = Path(__file__).resolve().parent.parent


def manage(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``manage.py`` in a fresh process with exactly the given environment additions.

    Start-up behaviour (configuration refusals, the SQLite default, logging) can only be
    observed in a new process, so these tests do not reuse the test runner's settings.
    """
    base = {
        k: v
        for k, v in os.environ.items()
        if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH") or k.startswith("OPENBLAS")
    }
    base["MILLM_ENV_FILE"] = "/nonexistent/.env"
    return subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args],
        env={**base, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def run_manage():
    return manage


@pytest.fixture(autouse=True)
def _no_process_copies():
    """Each test's database starts empty: no monitoring configuration or live steering
    that a previous test's process-local copy (core.process_copy) could still hold."""
    from monitoring.services import request_config
    from steering.live import live_copy

    for copy in (request_config, live_copy):
        copy.invalidate()
    yield
    for copy in (request_config, live_copy):
        copy.invalidate()


@pytest.fixture
def staff_client():
    """A Django test client logged in as a superuser (the admin's pages)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_superuser("root", "", "pw-for-tests")
    client = Client()
    client.force_login(user)
    return client
