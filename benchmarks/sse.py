"""Reading an OpenAI-style SSE stream in the /v1 benchmarks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def sse_events(resp: Any) -> Iterator[dict]:
    """The JSON events of a streamed ``http.client`` response, up to ``data: [DONE]``
    (each yielded as soon as its line arrives, so callers can time-stamp frames)."""
    while True:
        line = resp.readline()
        if not line:
            return
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)
