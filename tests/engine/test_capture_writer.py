"""Finished captures are packed and written on the engine's capture writer, not on the
worker that runs the batch (issue 38).

The writer is held in a test-only way: a ``CaptureWriter`` whose ``pack`` waits for an
event the test sets (the engine takes the writer it is given, as it takes any runtime
part).  While it is held, nothing but that request's final event can be waiting on it:
the other rows of the batch run to their end, and the capturing request's id reaches its
client only once its file is whole under its name.  No sleeps and no timing: each wait is
for an event that the code under test must produce, bounded only so a regression fails
rather than hangs.
"""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
import torch

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import (
    BatchingOptions,
    CaptureSpec,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    TokenEvent,
    Usage,
)
from gpu_engine.interp.capture import CapturePlan
from gpu_engine.runtime.capture_writer import CaptureWriter
from gpu_engine.runtime.engine import Engine

WAIT_S = 60  # a bound for a regression to fail on, never a measurement


class HeldWriter(CaptureWriter):
    """Packs only once ``gate`` is set; ``entered`` says a pack has begun."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        super().__init__()

    def pack(self, artifact):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never released the writer"
        return super().pack(artifact)


class Client:
    """A stream's events as its consumer receives them (``deliver_to``, on the thread
    that delivers), with what the capture's files looked like at that very moment."""

    def __init__(self, stream, directory=None) -> None:  # type: ignore[no-untyped-def]
        self.events: list = []
        self.files_at_final: list[str] | None = None
        self.readable_at_final = None
        self.done = threading.Event()
        self.directory = directory
        stream.deliver_to(self.take)

    def take(self, event) -> None:  # type: ignore[no-untyped-def]
        if isinstance(event, (FinishEvent, ErrorEvent)) and self.directory is not None:
            self.files_at_final = sorted(os.listdir(self.directory))
            cap = getattr(event, "capture", None)
            if cap is not None and cap.file is not None:
                self.readable_at_final = load_capture(self.directory / cap.file)
        self.events.append(event)
        if isinstance(event, (FinishEvent, ErrorEvent)):
            self.done.set()

    @property
    def final(self):  # type: ignore[no-untyped-def]
        return self.events[-1] if self.done.is_set() else None

    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]


def job(request_id: str, tokens: int, capture: CaptureSpec | None = None) -> GenerationJob:
    return GenerationJob(
        request_id,
        prompt=f"the writer test {request_id} runs on",
        capture=capture,
        sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def held_engine(tiny_assets):
    writer = HeldWriter()
    # two rows; the first prefill waits for both announced requests (gather_ms), so they
    # start together in one batch
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=2, gather_ms=10_000), capture_writer=writer)
    asset = tiny_assets.models["tiny-llama"]
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu"))
    yield eng, writer
    writer.gate.set()
    eng.shutdown()


def start_together(eng: Engine, *jobs: GenerationJob):  # type: ignore[no-untyped-def]
    with eng.arriving():
        return [eng.generate(j) for j in jobs]


def test_other_rows_finish_while_a_stored_capture_is_written_and_its_id_is_readable_when_told(held_engine, tmp_path):
    eng, writer = held_engine
    writer.gate.clear()
    writer.entered.clear()
    n_layers = eng.backend.num_layers
    spec = CaptureSpec(layers=list(range(n_layers)), positions="all", inline_max_bytes=0, directory=str(tmp_path))
    capturing, other = start_together(eng, job("cap", 3, spec), job("other", 40))
    cap_client, other_client = Client(capturing, tmp_path), Client(other)

    # the capturing request has ended and its artifact is on the writer, held there
    assert writer.entered.wait(WAIT_S)
    # ... and the other row of the batch goes on producing tokens to its end
    assert other_client.done.wait(WAIT_S), "the batch stalled while a capture was being written"
    assert isinstance(other_client.final, FinishEvent)
    assert len(other_client.tokens()) == 40 and other_client.final.finish_reason == "length"
    # the capturing client has its tokens, not its final event, and no file has its name
    assert cap_client.final is None
    assert len(cap_client.tokens()) == 3
    assert not [f for f in os.listdir(tmp_path) if not f.startswith(".tmp-")]

    writer.gate.set()
    assert cap_client.done.wait(WAIT_S)
    final = cap_client.final
    assert isinstance(final, FinishEvent) and final.capture is not None
    cid = final.capture.capture_id
    # when the client was told the id, both files were there under it and the file read back
    assert cap_client.files_at_final == [f"{cid}.json", f"{cid}.safetensors"]
    stored = cap_client.readable_at_final
    assert stored is not None and stored.meta["capture_id"] == cid
    assert (tmp_path / final.capture.file).stat().st_size == final.capture.nbytes
    # every row of prompt + completion but the last token, each layer's rows as an inline
    # capture of the same greedy request packs them
    n_prompt = final.usage.prompt_tokens
    rows = n_prompt + 3 - 1
    assert stored.positions.tolist() == list(range(rows))
    assert stored.token_ids.tolist() == (final.prompt_token_ids + final.token_ids)[:rows]
    again = eng.generate_sync(
        job("cap", 3, CaptureSpec(layers=list(range(n_layers)), positions="all")), timeout_s=WAIT_S
    )
    assert again.token_ids == final.token_ids
    inline = load_capture(again.capture.data)
    for layer in range(n_layers):
        assert stored.hidden[layer].shape == (rows, eng.backend.hidden_size)
        np.testing.assert_array_equal(stored.hidden[layer], inline.hidden[layer])


def test_a_capture_that_cannot_be_written_fails_its_request_alone(held_engine, tmp_path):
    eng, writer = held_engine
    writer.gate.set()
    blocked = tmp_path / "not-a-directory"
    blocked.write_bytes(b"x")  # the capture directory cannot be made here
    spec = CaptureSpec(layers=[0, 1], positions="all", inline_max_bytes=0, directory=str(blocked))
    capturing, other = start_together(eng, job("cap", 2, spec), job("other", 12))
    cap_client, other_client = Client(capturing), Client(other)
    assert cap_client.done.wait(WAIT_S) and other_client.done.wait(WAIT_S)
    err = cap_client.final
    assert isinstance(err, ErrorEvent)
    assert err.code == "generation_failed" and err.details["param"] == "capture"
    assert err.message.startswith("the capture could not be stored: ") and str(tmp_path) not in err.message
    assert len(cap_client.tokens()) == 2
    assert isinstance(other_client.final, FinishEvent) and len(other_client.tokens()) == 12
    assert sorted(os.listdir(tmp_path)) == ["not-a-directory"]


def test_shutdown_writes_the_artifacts_of_finished_requests_first(tiny_assets, tmp_path):
    writer = HeldWriter()
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=2), capture_writer=writer)
    asset = tiny_assets.models["tiny-llama"]
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu"))
    spec = CaptureSpec(layers=[0], positions="all", inline_max_bytes=0, directory=str(tmp_path))
    client = Client(eng.generate(job("cap", 2, spec)), tmp_path)
    assert writer.entered.wait(WAIT_S)
    closing = threading.Thread(target=eng.shutdown, kwargs={"timeout_s": WAIT_S})
    closing.start()
    assert client.final is None  # held: shutdown is waiting for the writer
    writer.gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    final = client.final
    assert isinstance(final, FinishEvent)
    assert client.files_at_final == [f"{final.capture.capture_id}.json", final.capture.file]


def plan_artifact(directory, request_id: str):  # type: ignore[no-untyped-def]
    plan = CapturePlan(
        CaptureSpec(layers=[0], positions="all", inline_max_bytes=0, directory=str(directory)),
        request_id=request_id,
        prompt_len=3,
        max_tokens=2,
        hidden_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        model="m",
        backend="transformers",
        steering_hash=None,
    )
    plan.observe(0, torch.arange(16, dtype=torch.float32).reshape(4, 4), 0)
    return plan.artifact(prompt_ids=[1, 2, 3], generated=[4, 5])


def test_close_past_its_wait_fails_what_is_still_queued_and_writes_what_was_begun(tmp_path):
    writer = HeldWriter()
    got: dict[str, list] = {"a": [], "b": [], "late": []}
    first, second = plan_artifact(tmp_path, "a"), plan_artifact(tmp_path, "b")
    writer.submit(first, FinishEvent("a", "length", "", [4, 5], Usage()), got["a"].append)
    assert writer.entered.wait(WAIT_S)  # "a" is being packed (held); "b" waits in the queue
    writer.submit(second, FinishEvent("b", "length", "", [4, 5], Usage()), got["b"].append)
    assert writer.close(timeout_s=0) is False
    [failed] = got["b"]
    assert isinstance(failed, ErrorEvent) and failed.code == "engine_shutdown"
    # handed over after close: failed at once, never written
    writer.submit(plan_artifact(tmp_path, "late"), FinishEvent("late", "length", "", [], Usage()), got["late"].append)
    assert [e.code for e in got["late"]] == ["engine_shutdown"]
    assert got["a"] == []
    writer.gate.set()
    writer._thread.join(WAIT_S)
    [done] = got["a"]
    assert isinstance(done, FinishEvent) and done.capture.file == f"{first.capture_id}.safetensors"
    cap = load_capture(tmp_path / done.capture.file)
    np.testing.assert_array_equal(cap.hidden[0], np.arange(16, dtype=np.float32).reshape(4, 4))
    assert sorted(os.listdir(tmp_path)) == [f"{first.capture_id}.json", f"{first.capture_id}.safetensors"]


def test_a_full_disk_is_capture_store_full_for_that_request_and_leaves_no_file(tmp_path, monkeypatch):
    """The disk fills while the tensors file is written (after its sidecar): the request
    gets capture_store_full, and neither the sidecar nor a temporary file stays."""
    real_fsync = os.fsync
    calls = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the tensors file; the sidecar went through
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    writer = CaptureWriter()
    got: list = []
    writer.submit(plan_artifact(tmp_path, "full"), FinishEvent("full", "length", "", [4, 5], Usage()), got.append)
    assert writer.close(timeout_s=WAIT_S)
    [err] = got
    assert isinstance(err, ErrorEvent) and err.request_id == "full"
    assert err.code == "capture_store_full"
    assert err.details["param"] == "capture" and err.details["reason"] == "disk_full"
    assert len(calls) == 2 and os.listdir(tmp_path) == []
