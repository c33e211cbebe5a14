"""Reading an OpenAI-style SSE stream in the /v1 benchmarks."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any


def sse_events(resp: Any) -> Iterator[dict]:
    """The JSON events of a streamed ``http.client`` response (or any binary reader with
    ``readline``), up to ``data: [DONE]`` (each yielded as soon as its line arrives, so
    callers can time-stamp frames)."""
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


def stream_clients(port: int, path: str, bodies: list[dict], *, timeout_s: float = 1200.0) -> list[dict]:
    """``len(bodies)`` concurrent streaming POSTs to ``path`` on 127.0.0.1:``port``, driven
    from this one thread with non-blocking sockets; returns per client ``sent`` / ``end``
    (perf_counter), ``frames`` (the time each frame with text arrived), ``tokens`` (the
    usage chunk's completion tokens), or ``error`` (status and body start).

    The clients share the server's cores in these benchmarks, so they do as little as
    possible while the streams run: one ``recv`` per readable socket, time-stamped, and
    the HTTP chunking, the SSE frames and their JSON are read only after the last stream
    closed.  (A thread per client reading line by line with ``json.loads`` per frame cost
    the 2-core machine ~1.5 ms of every 16-row decode step: docs/performance.md.)"""
    import selectors
    import socket
    import time

    sel = selectors.DefaultSelector()
    conns = []
    for body in bodies:
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        ).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        conns.append({"sock": sock, "request": head + data, "arrivals": []})
    for c in conns:  # all connected first, then sent back to back
        c["sent"] = time.perf_counter()
        c["sock"].sendall(c["request"])
        c["sock"].setblocking(False)
        sel.register(c["sock"], selectors.EVENT_READ, c)
    deadline = time.monotonic() + timeout_s
    left = len(conns)
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} stream(s) still open after {timeout_s} s")
        for key, _ in sel.select(timeout=1.0):
            c = key.data
            try:
                data = c["sock"].recv(1 << 16)
            except BlockingIOError:
                continue
            if data:
                c["arrivals"].append((time.perf_counter(), data))
                continue
            c["end"] = time.perf_counter()
            sel.unregister(c["sock"])
            c["sock"].close()
            left -= 1
    sel.close()
    return [_read_response(c) for c in conns]


def _read_response(c: dict) -> dict:
    """One recorded response: status, de-chunked body with each byte's arrival time, frames."""
    raw = b"".join(d for _, d in c["arrivals"])
    head, _, _ = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if status != 200:
        return {"error": status, "body": raw[len(head) + 4 :][:300].decode(errors="replace")}
    chunked = b"transfer-encoding: chunked" in head.lower()
    # the body as it arrived: (end offset in the decoded body, arrival time) per recv
    skip = len(head) + 4
    pending, body, marks = b"", bytearray(), []
    for t, data in c["arrivals"]:
        if skip:
            cut = min(skip, len(data))
            data, skip = data[cut:], skip - cut
        pending += data
        if not chunked:
            body += pending
            pending = b""
        else:
            while True:
                line_end = pending.find(b"\r\n")
                if line_end < 0:
                    break
                size = int(pending[:line_end].split(b";")[0], 16)
                if len(pending) < line_end + 2 + size + 2:
                    break
                body += pending[line_end + 2 : line_end + 2 + size]
                pending = pending[line_end + 2 + size + 2 :]
        marks.append((len(body), t))
    frames: list[float] = []
    tokens = 0
    m = 0
    reader = io.BytesIO(bytes(body))
    for event in sse_events(reader):
        while marks[m][0] < reader.tell():  # the recv that brought the frame's data line
            m += 1
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            frames.append(marks[m][1])
    return {"sent": c["sent"], "end": c["end"], "frames": frames, "tokens": tokens}
