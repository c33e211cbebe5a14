"""Small helpers shared by the documents tests."""

from __future__ import annotations

from typing import Any


def engine_attachments() -> list[Any]:
    from core.runtime import runtime

    return list(runtime().engine.attachments())
