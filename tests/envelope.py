"""Reading /api answers in tests: the envelope {success, data, error:{code, message, details}}."""

from __future__ import annotations

import json
from typing import Any


def body(response) -> dict:
    return json.loads(response.content)


def ok(response, status: int = 200) -> Any:
    data = body(response)
    assert response.status_code == status, data
    assert data["success"] is True and data["error"] is None, data
    return data["data"]


def refused(response, status: int, code: str) -> dict:
    data = body(response)
    assert response.status_code == status, data
    assert data["success"] is False and data["data"] is None, data
    assert data["error"]["code"] == code, data
    assert set(data["error"]) == {"code", "message", "details"}
    return data["error"]
