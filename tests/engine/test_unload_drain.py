"""An unload (or a model swap) drains the work the engine already accepted, whoever sent
it: new work is refused with engine_busy at once, running work gets the grace period,
then an unload stops it (its client gets engine_busy) and goes ahead, while a swap gives
up and leaves the model serving."""

from __future__ import annotations

import threading
import time

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import EngineBusy
from gpu_engine.api.protocol import (
    BatchingOptions,
    EmbedJob,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
)

STEP_S = 0.05  # each forward pass is slowed to this, so a stream's length is known


def job(rid: str, max_tokens: int) -> GenerationJob:
    return GenerationJob(
        rid, prompt="once upon a time", sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


@pytest.fixture(params=[False, True], ids=["serial", "batched"])
def engine(request, tiny_assets):
    eng = Engine(batching=BatchingOptions(enabled=request.param, max_batch_size=4))
    asset = tiny_assets.models["tiny-llama"]
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu"))
    layer = eng.backend.model.get_submodule("model.layers.0")
    layer.register_forward_hook(lambda *args: time.sleep(STEP_S))
    yield eng
    eng.shutdown()


def _first_token(stream):
    events = stream.events(30)
    first = next(events)
    assert first.type == "token", first
    return events


def _unload_in_thread(eng: Engine, timeout_s: float) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        started = time.monotonic()
        try:
            eng.unload_model(timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - looked at by the test
            outcome["error"] = exc
        outcome["took"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 5
    while eng.status().draining != "unloading":
        assert time.monotonic() < deadline, "the unload never started draining"
        time.sleep(0.01)
    return thread, outcome


def test_unload_waits_for_running_work_and_refuses_new(engine):
    events = _first_token(engine.generate(job("running", 30)))
    thread, outcome = _unload_in_thread(engine, timeout_s=30)
    # a newcomer is refused at once, with the reason, while the model is still there
    refused = list(engine.generate(job("late", 4)).events(5))
    assert [e.type for e in refused] == ["error"]
    assert refused[0].code == "engine_busy" and refused[0].details["reason"] == "unloading"
    with pytest.raises(EngineBusy):  # embeddings too
        engine.embed(EmbedJob("e", inputs=["hi"]), timeout_s=5)
    assert engine.status().state == "ready"
    rest = list(events)
    thread.join(30)
    assert rest[-1].type == "finish" and rest[-1].finish_reason == "length"
    assert len(rest[-1].token_ids) == 30  # the running request finished in full
    assert "error" not in outcome
    assert engine.status().state == "empty" and engine.status().draining is None


def test_unload_stops_work_that_outlasts_the_grace_period(engine):
    events = _first_token(engine.generate(job("long", 400)))  # ~20 s at STEP_S a token
    thread, outcome = _unload_in_thread(engine, timeout_s=0.5)
    rest = list(events)
    thread.join(30)
    assert rest[-1].type == "error" and rest[-1].code == "engine_busy", rest[-1]
    assert rest[-1].details["reason"] == "unloading"
    assert len([e for e in rest if e.type == "token"]) < 100
    assert "error" not in outcome and 0.5 <= outcome["took"] < 10
    assert engine.status().state == "empty"


def test_a_swap_gives_up_when_running_work_outlasts_its_wait(engine, tiny_assets):
    events = _first_token(engine.generate(job("long", 400)))
    gpt2 = tiny_assets.models["tiny-gpt2"]
    started = time.monotonic()
    with pytest.raises(EngineBusy):
        engine.load_model(LoadModelJob("tiny-gpt2", str(gpt2.path), dtype="float32", device="cpu"), timeout_s=0.5)
    assert time.monotonic() - started < 5
    status = engine.status()
    assert status.model_id == "tiny-llama" and status.draining is None
    # the running request was left alone and new ones are served again
    assert next(events).type == "token"
    after = engine.generate(job("after", 3)).result(30)
    assert after.finish_reason == "length" and len(after.token_ids) == 3


def test_cancel_all_stops_running_work_with_engine_busy(engine):
    events = _first_token(engine.generate(job("long", 400)))
    assert engine.cancel_all(reason="operator") == 1
    rest = list(events)
    assert rest[-1].type == "error" and rest[-1].code == "engine_busy", rest[-1]
    assert rest[-1].details["reason"] == "operator"
    after = engine.generate(job("after", 3)).result(30)  # the engine serves on
    assert after.finish_reason == "length" and len(after.token_ids) == 3


def test_a_backend_that_died_still_unloads_and_detaches(engine, tiny_assets):
    """vLLM's engine core can die under the backend; then its detach and close raise. The
    engine forgets the attachments and the model all the same: nothing stays resident (an
    unload that raised left the registry 'unloading' for good)."""
    from gpu_engine.api.protocol import AttachSpec

    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    backend = engine.backend

    def dead(*args, **kwargs):
        raise RuntimeError("EngineDeadError: the engine core died")

    backend.detach = dead
    backend.close = dead
    engine.unload_model(timeout_s=5)
    assert engine.status().state == "empty" and engine.attachments() == []
