"""The Redis Streams transport against a real redis-server: the delivery semantics of
``gpu_engine.server`` and ``core.engine_client_redis``, with a stand-in engine whose
timing the tests control (and one parity check with the real engine)."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time

import pytest
import redis

from core.engine_client_redis import RedisEngineClient
from gpu_engine.api.commands import COMMANDS, GenerateArgs
from gpu_engine.api.errors import EngineShutdown, ModelNotLoaded, SAENotAttached
from gpu_engine.api.protocol import (
    AttachSpec,
    EmbedJob,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    ScoreJob,
    TokenEvent,
    to_builtins,
)
from gpu_engine.api.transport import Envelope, Keys
from gpu_engine.server.config import ServerConfig
from gpu_engine.server.server import EngineAlreadyRunning, EngineServer
from tests.distributed.fakes import FAST, FakeEngine, fake_heartbeat, running_server


@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(4)}"


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def make_client(url: str, prefix: str, **kw) -> RedisEngineClient:
    return RedisEngineClient(
        url=url,
        prefix=prefix,
        heartbeat_s=FAST["heartbeat_s"],
        dead_after_s=FAST["dead_after_s"],
        command_timeout_s=kw.pop("command_timeout_s", 10),
        **kw,
    )


def gen_job(prompt: str = "hi", max_tokens: int = 5, rid: str | None = None) -> GenerationJob:
    return GenerationJob(
        request_id=rid or f"req-{secrets.token_hex(6)}",
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def pending(r: redis.Redis, keys: Keys, stream: str | None = None) -> int:
    try:
        return int(r.xpending(stream or keys.requests, keys.group)["pending"])
    except redis.ResponseError:
        return 0


def dead_letters(r: redis.Redis, keys: Keys) -> list[dict]:
    return [json.loads(f["data"]) for _, f in r.xrange(keys.dead_letter)]


def test_commands_and_requests_round_trip(redis_url, r, prefix):
    engine = FakeEngine()
    keys = Keys(prefix)
    with running_server(redis_url, engine, prefix, max_in_flight=2):
        client = make_client(redis_url, prefix)
        assert client.status().state == "empty"
        status = client.load_model(LoadModelJob(model_id="m", path="/x", device="cpu"))
        assert (status.state, status.model_id) == ("ready", "m")
        results = client.attach_set([AttachSpec(sae_id="sae_a", path="/s", layer=1)])
        assert [(x.sae_id, x.layer_module_path) for x in results] == [("sae_a", "model.layers.1")]
        # the heartbeat written before the reply already shows what the command changed
        assert [(a.sae_id, a.layer) for a in client.attachments()] == [("sae_a", 1)]
        assert client.backend_name == "fake"
        report = client.check_sae("/s", 9)
        assert (report.compatible, report.warnings) == (False, ["trained elsewhere"])
        with pytest.raises(SAENotAttached) as err:  # the engine's error class and details
            client.detach("sae_nope", 2)
        assert err.value.details == {"sae_id": "sae_nope", "layer": 2}
        assert client.detach("sae_a") == [("sae_a", 1)]
        assert client.resolve_device_and_dtype("auto", "auto") == ("cpu", "float32")

        events = list(client.generate(gen_job(max_tokens=4)).events(5))
        assert [type(e) for e in events] == [TokenEvent] * 4 + [FinishEvent]
        assert events[-1].text == "t0 t1 t2 t3 " and events[-1].finish_reason == "length"
        embedded = client.embed(EmbedJob(request_id="emb-1", inputs=["a", "b"]))
        assert embedded.embeddings == [[1.0, 0.0], [1.0, 0.0]]
        scored = client.score(ScoreJob(request_id="score-1", prompt="x", top_k=1))
        assert scored.top[0].token == "a"
        # everything acknowledged and removed from the work streams; no per-request leftovers
        assert pending(r, keys) == 0 and pending(r, keys, keys.commands) == 0
        assert r.xlen(keys.requests) == 0 and r.xlen(keys.commands) == 0
        assert not r.keys(f"{prefix}:req:*:events") and not r.keys(f"{prefix}:req:*:live")


def test_a_job_is_acknowledged_exactly_when_its_result_is_stored(redis_url, r, prefix):
    keys = Keys(prefix)
    with running_server(redis_url, FakeEngine(step_s=0.05), prefix):
        client = make_client(redis_url, prefix)
        seen_pending = []
        for event in client.generate(gen_job(max_tokens=6)).events(5):
            seen_pending.append(pending(r, keys))
            if isinstance(event, FinishEvent):
                break
        # held (pending) while tokens flow; acked in the MULTI that stored the final event
        # (the last token may arrive in the same read as the final event)
        assert len(seen_pending) == 7 and all(p == 1 for p in seen_pending[:-2])
        assert seen_pending[-1] == 0


def test_a_started_job_of_a_dead_engine_is_not_run_again(redis_url, r, prefix):
    """The engine died mid-generation: the client hears so, the job goes to the
    dead-letter stream, and the next engine never generates it."""
    keys = Keys(prefix)
    r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    client = make_client(redis_url, prefix)
    job = gen_job(max_tokens=5)
    with fake_heartbeat(redis_url, prefix, "dead-engine") as beat:
        handle = client.generate(job)
        # the dead engine had read it and marked it started
        r.xreadgroup(keys.group, "dead-engine", {keys.requests: ">"}, count=1)
        r.set(keys.started(job.request_id), "dead-engine")
        beat.set()  # ... and then stopped beating
    engine = FakeEngine()
    started = time.monotonic()
    with running_server(redis_url, engine, prefix):
        events = list(handle.events(10))
        elapsed = time.monotonic() - started
        assert isinstance(events[-1], ErrorEvent) and events[-1].code == "engine_shutdown"
        assert elapsed < FAST["dead_after_s"] + 2
        deadline = time.monotonic() + 5
        while not dead_letters(r, keys) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert job.request_id not in engine.generated
    [dead] = dead_letters(r, keys)
    assert dead["reason"] == "engine_died_while_running"
    assert json.loads(dead["entry"])["request_id"] == job.request_id
    assert pending(r, keys) == 0


def test_a_job_a_dead_engine_never_started_runs_once_on_the_next(redis_url, r, prefix):
    keys = Keys(prefix)
    r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    client = make_client(redis_url, prefix)
    job = gen_job(max_tokens=3)
    with fake_heartbeat(redis_url, prefix, "dead-engine") as beat:
        handle = client.generate(job)
        r.xreadgroup(keys.group, "dead-engine", {keys.requests: ">"}, count=1)  # read, not started
        beat.set()
    engine = FakeEngine()
    with running_server(redis_url, engine, prefix):
        events = list(handle.events(10))
    assert isinstance(events[-1], FinishEvent) and events[-1].text == "t0 t1 t2 "
    assert engine.generated == [job.request_id]
    assert dead_letters(r, keys) == [] and pending(r, keys) == 0


def test_a_job_delivered_too_often_goes_to_the_dead_letter_stream(redis_url, r, prefix):
    keys = Keys(prefix)
    r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    client = make_client(redis_url, prefix)
    job = gen_job()
    with fake_heartbeat(redis_url, prefix, "dead-1") as beat:
        handle = client.generate(job)
        [[_, [(msg_id, _)]]] = r.xreadgroup(keys.group, "dead-1", {keys.requests: ">"}, count=1)
        # three engines took it and died before starting it (the count says so)
        r.xclaim(keys.requests, keys.group, "dead-3", 0, [msg_id], retrycount=3)
        beat.set()
    engine = FakeEngine()
    with running_server(redis_url, engine, prefix, max_deliveries=3):
        events = list(handle.events(10))
    assert isinstance(events[-1], ErrorEvent) and events[-1].code == "generation_failed"
    assert "dead-letter" in events[-1].message
    assert engine.generated == []
    [dead] = dead_letters(r, keys)
    assert dead["reason"] == "max_deliveries" and pending(r, keys) == 0


def test_a_client_hears_of_a_dead_engine_within_the_bound(redis_url, prefix):
    client = make_client(redis_url, prefix)
    with fake_heartbeat(redis_url, prefix, "doomed") as beat:
        handle = client.generate(gen_job(prompt="hang"))
        time.sleep(0.3)
        beat.set()  # killed: no more heartbeats
        killed = time.monotonic()
        events = list(handle.events(30))
    waited = time.monotonic() - killed
    assert isinstance(events[-1], ErrorEvent) and events[-1].code == "engine_shutdown"
    assert waited < FAST["dead_after_s"] + FAST["heartbeat_s"] + 1.0
    # and from then on: nothing is resident, commands are refused at once
    with pytest.raises(ModelNotLoaded):
        client.status()
    with pytest.raises(EngineShutdown):
        client.load_model(LoadModelJob(model_id="m", path="/x"))
    [event] = list(client.generate(gen_job()).events(5))
    assert isinstance(event, ErrorEvent) and event.code == "model_not_loaded"


def test_cancelling_reaches_the_engine_within_a_step(redis_url, r, prefix):
    keys = Keys(prefix)
    engine = FakeEngine(step_s=0.02)
    with running_server(redis_url, engine, prefix):
        client = make_client(redis_url, prefix)
        job = gen_job(max_tokens=10_000)
        handle = client.generate(job)
        events = handle.events(5)
        for _ in range(3):
            assert isinstance(next(events), TokenEvent)
        cancelled = time.monotonic()
        handle.cancel()
        events.close()
        deadline = time.monotonic() + 5
        while engine.streams[job.request_id].cancelled_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stream = engine.streams[job.request_id]
        assert stream.cancelled_at is not None
        assert stream.cancelled_at - cancelled < FAST["cancel_poll_s"] + 0.5
        deadline = time.monotonic() + 5
        while pending(r, keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pending(r, keys) == 0


def test_leaving_an_async_stream_cancels_the_generation(redis_url, prefix):
    engine = FakeEngine(step_s=0.02)

    async def take_two(client: RedisEngineClient, job: GenerationJob) -> None:
        got = 0
        async for event in client.agenerate(job):
            got += isinstance(event, TokenEvent)
            if got == 2:
                break

    with running_server(redis_url, engine, prefix):
        client = make_client(redis_url, prefix)
        job = gen_job(max_tokens=10_000)
        asyncio.run(take_two(client, job))
        deadline = time.monotonic() + 5
        while engine.streams[job.request_id].cancelled_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.streams[job.request_id].cancelled_at is not None


def test_a_job_nobody_waits_for_any_more_is_never_run(redis_url, r, prefix):
    keys = Keys(prefix)
    engine = FakeEngine()
    with running_server(redis_url, engine, prefix):
        # queued by a client that then went away (its live key is gone)
        job = gen_job()
        r.xadd(keys.requests, Envelope.new(COMMANDS["generate"], job.request_id, GenerateArgs(job), wait_s=60).encode())
        deadline = time.monotonic() + 5
        while r.xlen(keys.requests) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.xlen(keys.requests) == 0 and pending(r, keys) == 0
    assert engine.generated == []


def test_shutdown_fails_running_requests_cleanly(redis_url, r, prefix):
    keys = Keys(prefix)
    client = make_client(redis_url, prefix)
    result: list = []
    with running_server(redis_url, FakeEngine(), prefix, shutdown_grace_s=0.3):
        handle = client.generate(gen_job(prompt="hang"))

        def consume() -> None:
            result.extend(handle.events(15))

        consumer = threading.Thread(target=consume)
        consumer.start()
        time.sleep(0.3)
    consumer.join(10)
    assert isinstance(result[-1], ErrorEvent) and result[-1].code == "engine_shutdown"
    assert pending(r, keys) == 0
    assert r.get(keys.heartbeat) is None and r.get(keys.owner) is None


def test_one_engine_per_prefix(redis_url, prefix):
    with running_server(redis_url, FakeEngine(), prefix):
        other = EngineServer(
            FakeEngine(), redis.Redis.from_url(redis_url, decode_responses=True), ServerConfig(prefix=prefix, **FAST)
        )
        with pytest.raises(EngineAlreadyRunning):
            other.acquire_ownership(wait_s=0.3)


def test_tokens_over_redis_equal_the_engine_in_process(redis_url, prefix, tiny_assets):
    """The transport carries the protocol dataclasses unchanged: the same greedy tokens,
    text, usage and monitoring records as calling the engine directly."""
    from gpu_engine.runtime.engine import Engine
    from gpu_engine.api.protocol import MonitorEntry, MonitorSpec, SteeringSpec

    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine = Engine()
    try:
        with running_server(redis_url, engine, prefix):
            client = make_client(redis_url, prefix)
            client.load_model(LoadModelJob(model_id="tiny-llama", path=str(model.path), dtype="float32", device="cpu"))
            client.attach_set([AttachSpec(sae_id="sae_t", path=str(sae.path), layer=1)])

            def job(rid: str) -> GenerationJob:
                return GenerationJob(
                    request_id=rid,
                    prompt="the sea",
                    sampling=SamplingParams(max_tokens=12, temperature=0, logprobs=True, top_logprobs=2),
                    steering=SteeringSpec.from_mapping({("sae_t", 1): {3: 4.0}}),
                    monitor=MonitorSpec([MonitorEntry("sae_t", 1, top_k=3)]),
                )

            remote = list(client.generate(job("over-redis")).events(30))
            local = list(engine.generate(job("in-process")).events(30))
        assert [to_builtins(e) | {"request_id": ""} for e in remote] == [
            to_builtins(e) | {"request_id": ""} for e in local
        ]
        assert remote[-1].steering_apply_count[0].count == remote[-1].forward_passes > 0
    finally:
        engine.shutdown()


@pytest.mark.django_db
def test_with_no_engine_running_api_says_engine_unavailable_and_v1_model_not_loaded(redis_url, settings, tiny_assets):
    """No run_engine heartbeat: /api's engine routes answer 503 ENGINE_UNAVAILABLE with
    Retry-After (an attach was a 500, a load a 400 MODEL_NOT_LOADED), /v1 its documented
    503 model_not_loaded (docs/deploy.md, "Submitting")."""
    from rest_framework.test import APIClient

    from core.runtime import runtime
    from registry import services
    from registry.models import Model

    settings.EMBEDDED = False
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "auto", "auto"
    llama = services.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")
    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    sae = services.sae_register_local(local_path=str(tiny_assets.saes["tiny-llama-L1-relu"].path), name="relu")
    Model.objects.filter(pk=llama.pk).update(status="loaded")  # what the rows recorded
    api = APIClient()
    with runtime().replaced(engine=make_client(redis_url, f"t{secrets.token_hex(4)}")):
        for response in (
            api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"),
            api.post(f"/api/models/{gpt2.id}/load"),
        ):
            assert response.status_code == 503, response.content
            assert response.json()["error"]["code"] == "ENGINE_UNAVAILABLE"
            assert response["Retry-After"] == str(settings.RETRY_AFTER_NOT_LOADED_S)
        v1 = api.post(
            "/v1/chat/completions",
            {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
            format="json",
        )
        assert v1.status_code == 503 and v1.json()["error"]["code"] == "model_not_loaded"
        assert v1["Retry-After"]
