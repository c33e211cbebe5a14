"""Continuous batching behind /v1 (daphne on a loopback socket, the real ASGI app):
concurrent requests with inline steering, a profile with an intensity dial,
``model@profile``, ``return_sae_activations`` and no steering share forward passes — no
serial fallback — and each answers exactly what it answers alone; /api/health/inference
reports the batching backend."""

from __future__ import annotations

import time

import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams
from steering.services import profile_create
from tests.engine.tolerances import BATCH_ENCODE_ATOL
from tests.v1.conftest import V1Server, _v1_db, attach, model_resident, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

from .conftest import Choreography

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "the sea and the sky"


@pytest.fixture
def batching_server(v1_server, settings):  # noqa: F811 - the imported fixture
    """The session's daphne, served by a continuous-batching engine with 8 slots."""
    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime
    from inference.admission import AdmissionController

    settings.ENABLE_CONTINUOUS_BATCHING = True
    settings.MAX_CONCURRENT_REQUESTS = 8
    client = EmbeddedEngineClient()
    server = V1Server(v1_server.url, client)
    try:
        with runtime().replaced(engine=client, admission=AdmissionController.from_settings()):
            model_resident(server, "tiny-llama")
            yield server
            server.wait_idle()
    finally:
        client.shutdown()


def _bodies(sae_id: str) -> dict[str, dict]:
    base = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return {
        "inline": {**base, "steering": {"features": [{"index": 3, "strength": 12.0}]}},
        "profile": {**base, "profile": "sea-lover", "steering_intensity": 0.5},
        "at_profile": {**base, "model": "tiny-llama@sea-lover", "prompt": PROMPT + " and"},
        "activations": {
            **base,
            "steering": {"features": [{"index": 40, "strength": -6.0}]},
            "return_sae_activations": {"top_k": 4, "features": [3, 7], "positions": "all"},
        },
        "plain": {**base, "prompt": "a quick brown fox"},
        "empty": {**base, "steering": {"features": []}},
    }


def test_mixed_v1_requests_share_steps_and_answer_as_alone(batching_server):
    server = batching_server
    sae = attach("tiny-llama-L1-relu", 1)
    profile_create(
        name="sea-lover", sae_id=sae.id, layer=1, steering={"3": 150.0, "40": -20.0}, model_name="tiny-llama"
    )
    bodies = _bodies(sae.id)

    alone = {}
    for name, body in bodies.items():
        resp = request(server.base_url, "POST", "/completions", body)
        assert resp.status == 200, resp.body[:300]
        alone[name] = resp.json()

    def tokens_generated() -> int:
        return request(server.url, "GET", "/api/health/metrics").json()["data"]["tokens_generated"]

    counted = tokens_generated()
    choreo = Choreography(server.engine.backend.model)
    together: dict[str, dict] = {}

    def send(name: str) -> None:
        resp = request(server.base_url, "POST", "/completions", bodies[name])
        together[name] = {"status": resp.status, "body": resp.json(), "steering": resp.headers["x-millm-steering"]}

    choreo.run_together(send, bodies)
    assert max(choreo.batch_sizes) >= 4, choreo.batch_sizes  # they shared decode steps
    # batched requests count their tokens as served ones do: each by the usage it reports
    assert (
        tokens_generated() - counted
        == sum(r["body"]["usage"]["completion_tokens"] for r in together.values())
        == 24 * len(bodies)
    )

    for name, want in alone.items():
        got = together[name]
        assert got["status"] == 200, got
        assert got["body"]["choices"][0]["text"] == want["choices"][0]["text"], name
        if "millm" in want:
            assert got["body"]["millm"]["steering"] == want["millm"]["steering"]
            assert got["body"]["millm"]["steering_apply_count"] == want["millm"]["steering_apply_count"]
    # positive control: steering changes the text
    assert alone["inline"]["choices"][0]["text"] != alone["empty"]["choices"][0]["text"]
    assert together["profile"]["steering"] == (
        f'profile;name=sea-lover;intensity=0.5;hash="{together["profile"]["body"]["millm"]["steering"]["hash"]}"'
    )
    got = together["activations"]["body"]["millm"]["sae_activations"]["positions"]
    want = alone["activations"]["millm"]["sae_activations"]["positions"]
    assert [r["position"] for r in got] == [r["position"] for r in want] and got
    for g, w in zip(got, want):
        assert [a["feature_index"] for a in g["top_k"]] == [a["feature_index"] for a in w["top_k"]]
        for a, b in zip(g["top_k"] + g["features"], w["top_k"] + w["features"]):
            assert a["activation"] == pytest.approx(b["activation"], abs=BATCH_ENCODE_ATOL)


def test_health_inference_reports_the_batching_backend(batching_server):
    resp = request(batching_server.url + "/api", "GET", "/health/inference")
    assert resp.status == 200
    data = resp.json()["data"]
    assert data["mode"] == "continuous_batching"
    assert data["capabilities"]["continuous_batching"] is True
    assert data["capabilities"]["per_request_steering"] and data["capabilities"]["exact_monitoring_attribution"]
    assert data["capabilities"]["serial_fallback"] is False
    batching = data["batching"]
    assert batching["enabled"] is True and batching["max_batch_size"] == 8
    assert batching["running"] == 0 and batching["waiting"] == 0


def test_each_row_of_a_batch_keeps_its_own_logit_bias(batching_server, tiny_assets):
    """Two requests with different logit_bias and one without share decode steps; each
    answers what it answers alone, and each bias did what it says."""
    from transformers import AutoTokenizer

    server = batching_server
    tok = AutoTokenizer.from_pretrained(tiny_assets.models["tiny-llama"].path)
    base = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = request(server.base_url, "POST", "/completions", base)
    assert plain.status == 200, plain.body[:300]
    ids = tok.encode(PROMPT, add_special_tokens=False)
    # the greedy first token, found without the server: the model's own argmax
    first = server.engine.generate_sync(
        GenerationJob("ref", prompt=PROMPT, sampling=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    ).token_ids[0]
    target = tok.encode(" lighthouse", add_special_tokens=False)[0]
    bodies = {
        "plain": base,
        "ban": {**base, "logit_bias": {str(first): -100}},
        "force": {**base, "prompt": ids, "logit_bias": {str(target): 100}},
    }
    alone = {}
    for name, body in bodies.items():
        resp = request(server.base_url, "POST", "/completions", body)
        assert resp.status == 200, resp.body[:300]
        alone[name] = resp.json()["choices"][0]["text"]
    assert alone["plain"] == plain.json()["choices"][0]["text"]
    assert alone["force"] == tok.decode([target] * 16, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert alone["ban"] != alone["plain"] and not alone["ban"].startswith(
        tok.decode([first], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    )

    choreo = Choreography(server.engine.backend.model)
    together: dict[str, str] = {}

    def send(name: str) -> None:
        resp = request(server.base_url, "POST", "/completions", bodies[name])
        together[name] = resp.json()["choices"][0]["text"] if resp.status == 200 else resp.body

    choreo.run_together(send, bodies)
    assert max(choreo.batch_sizes) == len(bodies), choreo.batch_sizes  # all in one step
    assert together == alone


def test_a_request_that_sends_no_sampling_gets_the_cbm_defaults(batching_server, settings):
    """CBM_DEFAULT_* are what a batched request that sends none gets; its own values win;
    the max_tokens default is a ceiling, never a refusal."""
    server = batching_server
    settings.CBM_DEFAULT_TEMPERATURE, settings.CBM_DEFAULT_TOP_P = 1.3, 0.5
    settings.CBM_DEFAULT_MAX_TOKENS = 7

    def engine_text(**sampling) -> str:
        return server.engine.generate_sync(
            GenerationJob("ref", prompt=PROMPT, sampling=SamplingParams(ignore_eos=True, seed=5, **sampling))
        ).text

    resp = request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "seed": 5, "ignore_eos": True},
    )
    assert resp.status == 200, resp.body[:300]
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["text"] == engine_text(max_tokens=7, temperature=1.3, top_p=0.5)
    # positive control: OpenAI's defaults would have drawn another text
    assert body["choices"][0]["text"] != engine_text(max_tokens=7, temperature=1.0, top_p=1.0)
    own = request(
        server.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPT,
            "seed": 5,
            "ignore_eos": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_tokens": 3,
        },
    ).json()
    assert own["choices"][0]["text"] == engine_text(max_tokens=3, temperature=1.0, top_p=1.0)
    # a prompt that leaves less room than the default: the room, not context_length_exceeded
    window = server.engine.backend.context_length
    settings.CBM_DEFAULT_MAX_TOKENS = 512
    long = request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": [5] * (window - 6), "temperature": 0, "ignore_eos": True},
    )
    assert long.status == 200, long.body[:300]
    assert long.json()["usage"]["completion_tokens"] == 6
    assert long.json()["choices"][0]["finish_reason"] == "length"


def test_extra_messages_run_together_and_answer_as_alone(batching_server):
    """extra_messages: several conversations in one request and one queue slot, run in one
    batch; choice c·n + i is conversation c's i-th choice, each what it answers alone."""
    server = batching_server
    conversations = [
        [{"role": "user", "content": "tell me about the sea"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and the sky?"}],
        [{"role": "user", "content": "a fox"}],
    ]
    base = {"model": "tiny-llama", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = []
    for messages in conversations:
        resp = request(server.base_url, "POST", "/chat/completions", {**base, "messages": messages})
        assert resp.status == 200, resp.body[:300]
        alone.append(resp.json())
    choreo = Choreography(server.engine.backend.model)
    with choreo.installed():
        resp = request(
            server.base_url,
            "POST",
            "/chat/completions",
            {**base, "messages": conversations[0], "extra_messages": conversations[1:]},
        )
    assert resp.status == 200, resp.body[:300]
    assert max(choreo.batch_sizes) == 3, choreo.batch_sizes  # one batch, not three runs
    body = resp.json()
    assert resp.headers["x-millm-batch"] == "conversations=3;choices=3"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, want in zip(body["choices"], alone):
        assert choice["message"]["content"] == want["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert body["usage"]["completion_tokens"] == 36
    # with n = 2: conversation c's choices are 2c and 2c + 1
    two = request(
        server.base_url,
        "POST",
        "/chat/completions",
        {**base, "n": 2, "messages": conversations[0], "extra_messages": conversations[2:]},
    ).json()
    texts = [c["message"]["content"] for c in two["choices"]]
    assert (
        texts == [alone[0]["choices"][0]["message"]["content"]] * 2 + [alone[2]["choices"][0]["message"]["content"]] * 2
    )
    bad = request(
        server.base_url, "POST", "/chat/completions", {**base, "messages": conversations[0], "extra_messages": [[]]}
    )
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_parameter"


@pytest.fixture
def gather_3s(settings):
    """CBM_GATHER_MS=3000 for the batching server built after it."""
    settings.CBM_GATHER_MS = 3000


def test_a_burst_of_v1_requests_starts_as_one_batch(gather_3s, batching_server, monkeypatch):
    """/v1 announces each generation request to the engine as it comes in: a request
    still being planned when the others of its burst reach the idle engine is waited for
    (CBM_GATHER_MS), so the whole burst is prefilled before the first decode step. Here
    one request's planning takes 0.5 s (a slow database, say): without the announcement
    the other three would be prefilled and decoding long before it arrives."""
    import asyncio

    import inference.serving as serving

    server = batching_server
    slow_prompt = "the slow one"
    planned = serving.plan_generation

    async def plan_slowly(**kw):  # noqa: ANN003, ANN202
        if slow_prompt in str(kw["req"].prompt):
            await asyncio.sleep(0.5)
        return await planned(**kw)

    monkeypatch.setattr(serving, "plan_generation", plan_slowly)
    base = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    bodies = [
        {**base, "prompt": PROMPT},
        {**base, "prompt": PROMPT, "stream": True},
        {**base, "prompt": "a quick brown fox"},
        {**base, "prompt": slow_prompt},
    ]
    statuses: list[int] = []
    sent: list[float] = []

    def send(body: dict) -> None:
        statuses.append(request(server.base_url, "POST", "/completions", body).status)

    choreo = Choreography(server.engine.backend.model)
    choreo.run_together(send, bodies, on_release=lambda: sent.append(time.monotonic()))
    assert statuses == [200] * len(bodies)
    # the wait ended when the slow request was submitted (each request withdraws its
    # announcement as it submits), not at the end of CBM_GATHER_MS
    waited = choreo.started[0] - sent[0]
    assert 0.45 < waited < 2.5, (waited, choreo.shapes)
    prefilled, decodes = choreo.prefills_then_decodes()
    # prompts of different lengths are prefilled in groups, all before the first decode
    assert prefilled == len(bodies), choreo.shapes
    assert decodes == [len(bodies)] * 5, choreo.shapes


def test_every_v1_request_withdraws_its_announcement(batching_server):
    """Whatever way a /v1 generation request ends — streamed, answered whole, refused
    before it reached the engine — nothing stays announced: an announcement left behind
    would hold every later idle start for CBM_GATHER_MS (/api/health/inference shows
    what is announced)."""
    server = batching_server
    base = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 3}
    for body, status in (
        ({**base}, 200),
        ({**base, "stream": True}, 200),
        ({**base, "temperature": 7}, 400),
        ({**base, "model": "no-such-model"}, 404),
    ):
        resp = request(server.base_url, "POST", "/completions", body)
        assert resp.status == status, resp.body[:300]
    resp = request(
        server.base_url,
        "POST",
        "/chat/completions",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert resp.status == 200, resp.body[:300]
    batching = request(server.url + "/api", "GET", "/health/inference").json()["data"]["batching"]
    assert batching["arriving"] == 0 and batching["gather_ms"] == 50
