"""What the attacks across keys share (test_experiments_security.py,
test_fidelity_security.py, test_dashboards_security.py): a call to the live server as one
of tests/v1's keys (or none; tests/experiments' ``api``, the key named first), its envelope
read, and a run polled until it ends."""

from __future__ import annotations

import time
from typing import Any

from tests.experiments.conftest import api


def call(server, who: str | None, method: str, path: str, body: Any = None, **kw) -> tuple[int, Any]:
    """The status and the JSON body (the raw bytes where the body is not JSON) of a call
    made with ``who``'s key, or with no key where ``who`` is None."""
    return api(server, method, path, body, who, **kw)


def answer(got: tuple[int, Any], status: int, code: str | None = None) -> Any:
    status_got, body = got
    assert status_got == status, body
    if code is None:
        assert body["success"] is True, body
        return body["data"]
    assert body["success"] is False and body["error"]["code"] == code, body
    return body["error"]


def wait_ended(server, who: str, path: str, timeout_s: float) -> dict:
    """The run at ``path`` as ``who`` reads it, once it has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = answer(call(server, who, "GET", path), 200)
        if run["status"] in ("completed", "failed", "cancelled"):
            return run
        assert time.monotonic() < deadline, f"still {run['status']} after {timeout_s} s"
        time.sleep(0.1)
