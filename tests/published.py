"""Events recorded as they are published, for the tests that check what a change told the
browser: ``recording(monkeypatch, owner)`` replaces ``owner.publish`` (``core.events`` or
the runtime's bus) with one that records each event, then publishes it as before."""

from __future__ import annotations

import json
from typing import Any


def recording(monkeypatch: Any, owner: Any) -> list[tuple[str, dict]]:
    """Every event published through ``owner`` from now on, in order, as (name, data), the
    data as it crosses JSON."""
    seen: list[tuple[str, dict]] = []
    real = owner.publish

    def record(event: str, data: dict) -> None:
        seen.append((event, json.loads(json.dumps(data))))
        real(event, data)

    monkeypatch.setattr(owner, "publish", record)
    return seen
