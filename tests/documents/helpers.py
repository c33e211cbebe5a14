"""Small helpers shared by the documents tests."""

from __future__ import annotations

from typing import Any


def engine_attachments() -> list[Any]:
    from inference.engine_client import get_engine_client

    return list(get_engine_client().attachments())
