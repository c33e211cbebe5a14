"""How a batch step's events reach their consumers: every row's event of one step in one
burst (``gpu_engine.runtime.stream.held_deliveries``), and one wake-up of the web tier's event
loop per burst, however many streams it touches (``core.engine_client._LoopInbox``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.engine_client import EmbeddedEngineClient, _LoopInbox
from gpu_engine.runtime.worker import _WORK
from gpu_engine.api.protocol import FinishEvent, GenerationJob, GenerationResult, SamplingParams, TokenEvent, Usage
from gpu_engine.runtime.stream import GenerationStream, held_deliveries

PROMPTS = ["the cat sat on the mat and", "a quick brown fox jumps over", "hello", "the sun rises over the hills and"]
TOKENS = 8


def token(rid: str, i: int) -> TokenEvent:
    return TokenEvent(rid, i, 100 + i, f"t{i}")


def finish(rid: str) -> FinishEvent:
    return FinishEvent(rid, "length", "", [], Usage())


def test_a_held_burst_reaches_each_consumer_in_order_then_wakes_each_once():
    log: list[tuple[str, object]] = []
    a, b, queued = GenerationStream("a"), GenerationStream("b"), GenerationStream("q")

    def wake_1() -> None:  # two streams of one consumer (one event loop) share its wake
        log.append(("wake-1", None))

    a.deliver_to(lambda e: log.append(("a", e.index)), wake_1)
    b.deliver_to(lambda e: log.append(("b", getattr(e, "index", "end"))), wake_1)

    a._put(token("a", 0))  # outside a block: delivered and woken at once
    assert log == [("a", 0), ("wake-1", None)]
    log.clear()
    with held_deliveries():
        a._put(token("a", 1))
        b._put(token("b", 0))
        with held_deliveries():  # nested: handed over at the outer block's end
            a._put(token("a", 2))
        queued._put(token("q", 0))  # nobody delivers to it: queued at once
        assert log == []
        assert queued._events.qsize() == 1
        b._put(finish("b"))
    assert log == [("a", 1), ("b", 0), ("a", 2), ("b", "end"), ("wake-1", None)]


def test_a_burst_is_handed_over_even_when_the_step_fails():
    got: list[int] = []
    s = GenerationStream("a")
    s.deliver_to(lambda e: got.append(e.index))
    with pytest.raises(RuntimeError), held_deliveries():
        s._put(token("a", 0))
        raise RuntimeError("a failing step")
    assert got == [0]


def test_events_produced_before_delivery_starts_are_handed_over_with_one_wake():
    s = GenerationStream("a")
    s._put(token("a", 0))
    s._put(token("a", 1))
    got: list[int] = []
    wakes: list[int] = []
    s.deliver_to(lambda e: got.append(e.index), lambda: wakes.append(len(got)))
    assert got == [0, 1] and wakes == [2]


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


def test_a_batch_wakes_its_consumer_once_per_step_not_once_per_row(engines):
    """Four requests decoding together: each step's four events come with one wake,
    and each stream still gets all its events, in order, ending with its finish."""
    batched, serial = engines("tiny-llama")
    solo = [
        serial.generate_sync(GenerationJob(f"solo-{i}", prompt=p, sampling=greedy())) for i, p in enumerate(PROMPTS)
    ]
    lock = threading.Lock()
    got: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    wakes: list[int] = []
    done = threading.Event()

    def deliver(i: int):
        def take(event) -> None:
            with lock:
                got[i].append(event)
                if sum(isinstance(e[-1], FinishEvent) for e in got.values() if e) == len(PROMPTS):
                    done.set()

        return take

    def wake() -> None:
        with lock:
            wakes.append(sum(len(e) for e in got.values()))

    # the engine's worker waits on a task of ours until all four are queued, so they
    # start in one step
    gate = threading.Event()
    batched._submit(gate.wait, _WORK)
    streams = [batched.generate(GenerationJob(f"row-{i}", prompt=p, sampling=greedy())) for i, p in enumerate(PROMPTS)]
    for i, s in enumerate(streams):
        s.deliver_to(deliver(i), wake)
    gate.set()
    assert done.wait(60)
    events = sum(len(e) for e in got.values())
    assert events == len(PROMPTS) * (TOKENS + 1)
    # the first token comes from the prefill step; then one step per token: ~TOKENS + 1
    # wakes for 36 events (one wake per event would be 36)
    assert len(wakes) <= TOKENS + 2, wakes
    for i, want in enumerate(solo):
        tokens = [e for e in got[i] if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(TOKENS))
        assert [e.token_id for e in tokens] == want.token_ids
        assert isinstance(got[i][-1], FinishEvent) and got[i][-1].token_ids == want.token_ids


def test_a_first_token_is_handed_over_before_the_next_decode_step(engines):
    """The prefill's first token does not wait for the decode step after it: a request
    that joins a running batch gets its first token before the batch's next forward."""
    from .conftest import Choreography

    batched, _ = engines("tiny-llama")
    choreo = Choreography(batched.backend.model)
    first_at: dict[str, int] = {}
    done = threading.Event()
    streams: dict[str, GenerationStream] = {}

    def watch(name: str):
        def take(event) -> None:
            if isinstance(event, TokenEvent) and name not in first_at:
                first_at[name] = len(choreo.batch_sizes)  # forward passes started so far
            if isinstance(event, FinishEvent) and name == "joins":
                done.set()

        return take

    def submit(name: str, prompt: str) -> None:  # on the engine's thread, before a forward
        streams[name] = batched.generate(GenerationJob(name, prompt=prompt, sampling=greedy()))
        streams[name].deliver_to(watch(name))

    choreo.on(3, lambda: submit("joins", PROMPTS[1]))
    with choreo.installed():
        submit("first", PROMPTS[0])
        assert done.wait(60)
    # forward 1: the first request's prefill; its first token comes before forward 2
    assert first_at["first"] == 1
    # "joins" was queued before forward 3, so it is admitted (prefilled alone) right after
    # that decode step: its first token is handed over before the next decode forward
    joined = next(n for n, shape in enumerate(choreo.shapes, 1) if n > 3 and shape[1] > 1)
    assert first_at["joins"] == joined, (choreo.shapes, first_at)


def test_the_web_tiers_loop_is_woken_once_per_step_for_all_its_streams(engines):
    """``EmbeddedEngineClient.agenerate`` on one event loop, four streams at once: the
    engine schedules the loop once per batch step (``call_soon_threadsafe``), and every
    stream yields its whole generation."""
    batched, serial = engines("tiny-llama")
    solo = [
        serial.generate_sync(GenerationJob(f"solo2-{i}", prompt=p, sampling=greedy())).token_ids
        for i, p in enumerate(PROMPTS)
    ]
    client = EmbeddedEngineClient.__new__(EmbeddedEngineClient)
    client._engine = batched  # the module's batching engine, not one built from settings
    scheduled: list[object] = []

    async def run() -> list[GenerationResult]:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kw):  # noqa: ANN001, ANN202
            if threading.current_thread() is not threading.main_thread():
                scheduled.append(callback)
            return original(callback, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        gate = threading.Event()
        batched._submit(gate.wait, _WORK)

        async def one(i: int) -> GenerationResult:
            events = []
            async for event in client.agenerate(GenerationJob(f"loop-{i}", prompt=PROMPTS[i], sampling=greedy())):
                events.append(event)
            return GenerationResult.from_events(events)

        tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
        await asyncio.sleep(0.05)  # every agenerate has submitted its job behind the gate
        gate.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == solo
    assert len(scheduled) <= TOKENS + 2, len(scheduled)


def test_an_inbox_whose_loop_closed_refuses_events():
    loop = asyncio.new_event_loop()
    inbox = _LoopInbox.of(loop)
    assert _LoopInbox.of(loop) is inbox
    q: asyncio.Queue = asyncio.Queue()
    assert inbox.put(q, token("a", 0))
    inbox.wake()
    loop.run_until_complete(asyncio.sleep(0))
    assert q.get_nowait().index == 0
    loop.close()
    assert not inbox.put(q, token("a", 1))
    inbox.wake()  # nothing to schedule on a closed loop: no error
