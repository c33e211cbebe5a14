"""The grammar builder's deadline is a schema's own: a schema that waits for a free child
(every child building another request's schema) is not blamed for their time — it is
built once a child comes free, or refused as ``engine_busy`` (retry) when none does
within the builder's wait, never ``schema_too_complex``.

The test holds the builder's only child itself (no costly schema, no timing race): the
waiting schema's fate is decided by when the test gives the child back."""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from gpu_engine.api.errors import EngineBusy
from gpu_engine.api.protocol import StructuredOutput
from gpu_engine.decode.grammar import GrammarBuilder


def fresh_schema() -> StructuredOutput:
    """A schema no earlier build has remembered (the builder answers repeats from its LRU)."""
    return StructuredOutput("json_schema", json.dumps({"enum": [secrets.token_hex(4), "b"]}))


def build_in_thread(builder: GrammarBuilder, spec: StructuredOutput) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["grammar"] = builder.build(spec)
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_until_waiting(builder: GrammarBuilder, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 60
    while builder.stats["building"] < 1:
        assert thread.is_alive() and time.monotonic() < deadline, "the schema never asked for a child"
        time.sleep(0.01)


def test_a_schema_that_waited_for_a_child_longer_than_the_deadline_is_still_built():
    builder = GrammarBuilder(timeout_s=2.0, workers=1, wait_s=600)
    try:
        held, _ = builder._take(time.monotonic() + 60)  # the only child, busy elsewhere
        assert held is not None
        thread, out = build_in_thread(builder, fresh_schema())
        wait_until_waiting(builder, thread)
        time.sleep(2.5)  # longer than the schema's deadline, all of it spent waiting
        assert thread.is_alive() and not out  # still waiting, not refused
        builder._give_back(held)
        thread.join(120)
        assert "error" not in out, out.get("error")
        assert out["grammar"] is not None and builder.stats["timed_out"] == 0
    finally:
        builder.close()


def test_a_schema_that_finds_no_child_within_the_wait_is_busy_not_too_complex():
    builder = GrammarBuilder(timeout_s=60.0, workers=1, wait_s=0.5)
    try:
        held, _ = builder._take(time.monotonic() + 60)
        assert held is not None
        thread, out = build_in_thread(builder, fresh_schema())
        thread.join(120)  # the child stays held until the schema has given up
        with pytest.raises(EngineBusy) as caught:
            raise out["error"]
        assert caught.value.code == "engine_busy"
        assert caught.value.details["reason"] == "grammar_builders_busy"
        builder._give_back(held)
        # the refused schema took nothing: the child serves the next one
        assert builder.build(fresh_schema()) is not None
        assert builder._started == 1
    finally:
        builder.close()
