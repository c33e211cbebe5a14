"""A stand-in engine for transport tests: the same methods as ``gpu_engine.runtime.engine.Engine``,
token timing under the test's control, and a record of what it was asked to run."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from gpu_engine.api.errors import EngineBusy, SAENotAttached
from gpu_engine.api.protocol import (
    AttachmentStatus,
    AttachResult,
    CompatibilityReport,
    EmbedResult,
    EngineStatus,
    ErrorEvent,
    FinishEvent,
    HiddenStatesResult,
    TokenizeResult,
    LogprobEntry,
    ScoreResult,
    TokenEvent,
    Usage,
    to_builtins,
)
from gpu_engine.api.transport import Keys
from gpu_engine.server.config import ServerConfig
from gpu_engine.server.server import EngineServer


class FakeStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self.cancelled_at: float | None = None
        self.fail_with: Any = None  # cancel_all: the error the generation ends with
        self.finished = False

    def cancel(self) -> None:
        if not self._cancel.is_set():
            self.cancelled_at = time.monotonic()
        self._cancel.set()

    def events(self, timeout_s: float | None = None) -> Iterator[Any]:
        done = False
        try:
            while True:
                try:
                    event = self._events.get(timeout=timeout_s)
                except queue.Empty:
                    raise EngineBusy("no event") from None
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    done = True
                yield event
                if done:
                    return
        finally:
            if not done:
                self.cancel()


class FakeEngine:
    """Token ``i`` is the text ``t<i> `` every ``step_s``; a prompt ``"hang"`` produces
    nothing until cancelled. Cancellation is checked before every step, as the real
    engine does before every forward pass."""

    def __init__(self, *, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.model_id: str | None = None
        self.attached: dict[tuple[str, int], str] = {}
        self.generated: list[str] = []
        self.streams: dict[str, FakeStream] = {}
        self.embedded: list[str] = []

    def status(self) -> EngineStatus:
        return EngineStatus(
            state="ready" if self.model_id else "empty",
            backend="fake",
            model_id=self.model_id,
            attachments=self.attachments(),
            in_flight=sum(1 for s in self.streams.values() if s.cancelled_at is None),
        )

    def attachments(self) -> list[AttachmentStatus]:
        return [
            AttachmentStatus(
                sae_id=s,
                layer=n,
                layer_module_path=f"model.layers.{n}",
                d_in=8,
                d_sae=16,
                activation="relu",
                layout="saelens",
                path=p,
            )
            for (s, n), p in self.attached.items()
        ]

    def check_load(self, job: Any) -> None:
        return None

    def build_grammar(self, spec: Any) -> None:
        return None

    def load_model(self, job: Any, *, timeout_s: float | None = None) -> EngineStatus:
        self.model_id = job.model_id
        self.attached.clear()
        return self.status()

    def unload_model(self, *, timeout_s: float | None = None) -> None:
        self.model_id = None
        self.attached.clear()

    def attach_set(self, specs: Any, *, timeout_s: float | None = None) -> list[AttachResult]:
        out = []
        for spec in specs:
            self.attached[(spec.sae_id, spec.layer)] = spec.path
            out.append(AttachResult(spec.sae_id, spec.layer, f"model.layers.{spec.layer}", 8, 16, "relu", "saelens"))
        return out

    def detach(
        self, sae_id: str | None = None, layer: int | None = None, *, timeout_s: float | None = None
    ) -> list[tuple[str, int]]:
        keys = [k for k in self.attached if (sae_id is None or k[0] == sae_id) and (layer is None or k[1] == layer)]
        if not keys and sae_id is not None:
            raise SAENotAttached(f"SAE {sae_id!r} is not attached", details={"sae_id": sae_id, "layer": layer})
        for k in keys:
            del self.attached[k]
        return keys

    def check_sae(self, path: str, layer: int, *, layout: str | None = None) -> Any:
        return CompatibilityReport(
            compatible=layer < 4, errors=[] if layer < 4 else ["range"], warnings=["trained elsewhere"]
        )

    def generate(self, job: Any) -> FakeStream:
        self.generated.append(job.request_id)
        stream = FakeStream(job.request_id)
        self.streams[job.request_id] = stream
        threading.Thread(target=self._run, args=(job, stream), daemon=True).start()
        return stream

    def _run(self, job: Any, stream: FakeStream) -> None:
        n = job.sampling.max_tokens or 16
        text = ""
        i = 0
        while i < n:
            if stream._cancel.is_set():
                err = stream.fail_with
                stream._events.put(
                    FinishEvent(job.request_id, "cancelled", text, list(range(i)), Usage(3, i, 3 + i))
                    if err is None
                    else ErrorEvent(job.request_id, err.code, err.message, err.details)
                )
                stream.finished = True
                return
            if job.prompt == "hang":
                time.sleep(0.01)
                continue
            time.sleep(self.step_s)
            piece = f"t{i} "
            text += piece
            stream._events.put(TokenEvent(job.request_id, i, i, piece))
            i += 1
        stream._events.put(
            FinishEvent(job.request_id, "length", text, list(range(n)), Usage(3, n, 3 + n), forward_passes=n)
        )
        stream.finished = True

    def cancel_all(self, reason: str = "cancel_all") -> int:
        live = [s for s in self.streams.values() if not s.finished and s.cancelled_at is None]
        for stream in live:
            stream.fail_with = EngineBusy(f"stopped ({reason})", details={"reason": reason})
            stream.cancel()
        return len(live)

    def embed(self, job: Any, *, timeout_s: float | None = None) -> EmbedResult:
        self.embedded.append(job.request_id)
        return EmbedResult(job.request_id, [[1.0, 0.0]] * len(job.inputs), Usage(len(job.inputs), 0, len(job.inputs)))

    def score(self, job: Any, *, timeout_s: float | None = None) -> ScoreResult:
        return ScoreResult(job.request_id, 3, top=[LogprobEntry(1, "a", -0.5)])

    def hidden_states(self, job: Any, *, timeout_s: float | None = None) -> HiddenStatesResult:
        return HiddenStatesResult(
            job.request_id,
            list(job.layers),
            [[[1.0, 0.0]] * len(job.layers)] * len(job.inputs),
            Usage(len(job.inputs), 0, len(job.inputs)),
        )

    def tokenize(self, job: Any, *, timeout_s: float | None = None) -> TokenizeResult:
        return TokenizeResult(job.request_id, [list(t.encode()) for t in job.texts])

    def feature_logits(self, job: Any, *, timeout_s: float | None = None) -> Any:
        raise SAENotAttached(f"SAE {job.sae_id!r} is not attached at layer {job.layer}")

    def attribution(self, job: Any, *, timeout_s: float | None = None) -> Any:
        raise SAENotAttached(f"SAE {job.sae_id!r} is not attached at layer {job.layer}")


# The in-process servers share the pytest process's heap: the engine's gc.collect() after an
# unload holds the GIL for as long as a collection of everything the suite has built takes
# (over 0.6 s on a loaded 2-core machine), so "dead" waits for 2 s of silence.
FAST = {"heartbeat_s": 0.1, "dead_after_s": 2.0, "cancel_poll_s": 0.05}


@contextmanager
def running_server(url: str, engine: Any, prefix: str, **overrides: Any) -> Iterator[EngineServer]:
    """An EngineServer serving ``engine`` on a thread until the block ends."""
    client = redis.Redis.from_url(url, decode_responses=True)
    config = ServerConfig(prefix=prefix, **{**FAST, **overrides})
    server = EngineServer(engine, client, config, describe=lambda: {"defaults": {"device": "cpu", "dtype": "float32"}})
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    keys = Keys(prefix)
    deadline = time.monotonic() + 10
    while True:
        raw = client.get(keys.heartbeat)
        if raw and json.loads(raw).get("phase") == "serving":
            break
        assert time.monotonic() < deadline, "the server did not start serving"
        time.sleep(0.02)
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=20)
        assert not thread.is_alive(), "the server did not stop"
        client.close()


@contextmanager
def fake_heartbeat(
    url: str, prefix: str, engine_id: str, *, ttl_ms: int = int(FAST["dead_after_s"] * 1000), every_s: float = 0.1
) -> Iterator[threading.Event]:
    """A heartbeat as a serving engine would write it (expiring ``dead_after`` after its
    last beat), until the returned event is set (then it simply stops, as a killed
    engine's does)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(prefix)
    stop = threading.Event()
    payload = json.dumps(
        {
            "engine_id": engine_id,
            "phase": "serving",
            "status": to_builtins(EngineStatus(state="ready", model_id="fake")),
            "defaults": {"device": "cpu", "dtype": "float32"},
        }
    )

    def beat() -> None:
        while not stop.is_set():
            client.set(keys.heartbeat, payload, px=ttl_ms)
            stop.wait(every_s)

    client.set(keys.heartbeat, payload, px=ttl_ms)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=5)
        client.close()
