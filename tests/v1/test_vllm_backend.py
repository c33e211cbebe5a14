"""/v1 and /api end to end with the model on the vLLM backend: the tiny Llama is registered,
switched to ``backend=vllm`` and loaded through /api (one vLLM engine for the module, in
the session's one real server), an SAE attached through /api, and then the official
``openai`` client: greedy and steered output equal the transformers backend's on the same
weights and the same resolved spec, ``return_sae_activations`` and /api monitoring return
records, profiles (``model@profile``) and live steering steer, ``capture`` is stored and
equals the transformers backend's, the backend names itself
(X-miLLM-Backend, /api/health/inference), scoring mode (``allowed_token_ids``) equals the
test's own forward, and what vLLM cannot do is a 400 before anything runs.  Like tests/vllm, this fails instead of skipping when ``MILLM_REQUIRE_VLLM=1``."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import numpy as np
import openai
import pytest
import torch

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from tests.v1.conftest import _register_assets, model_resident
from tests.v1.helpers import assert_openai_error, request
from tests.vllm.conftest import require_vllm
from tests.vllm.test_vllm_engine import VLLM_ACT_ATOL

PROMPT = "the sea and the sky"
TOKENS = 16
FEATURES = {3: 12.0, 40: -6.5}


def _call(server, method: str, path: str, body=None):
    resp = request(server.url, method, "/api" + path, body, timeout=300)
    assert resp.status < 300, (method, path, resp.status, resp.body[:500])
    return resp.json()["data"]


def _wait_job(server, job_id: int, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = _call(server, "GET", f"/jobs/{job_id}")
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def on_vllm(v1_server, django_db_blocker, tiny_assets):
    """tiny-llama loaded on vLLM through /api: PATCH backend=vllm, POST load, the job
    followed to its end. The transformers backend on the same weights is the reference
    (``ref``). Every test's rows are truncated after it: MILLM_BACKEND=vllm then keeps the
    re-registered row's effective backend what the engine runs."""
    require_vllm()
    from django.conf import settings

    from registry.models import Model

    names = ("MILLM_BACKEND", "VLLM_DISTRIBUTED_EXECUTOR", "VLLM_MAX_NUM_SEQS")
    saved = {name: getattr(settings, name) for name in names}
    # one process: vLLM's engine core and its worker run in the server's (start-up ~40 s)
    settings.VLLM_DISTRIBUTED_EXECUTOR = "uni"
    settings.VLLM_MAX_NUM_SEQS = 8
    v1_server.engine.unload_model()
    with django_db_blocker.unblock():
        _register_assets()
        model = Model.objects.get(name="tiny-llama")
        assert model.effective_backend() == "transformers"
        detail = _call(v1_server, "PATCH", f"/models/{model.id}", {"backend": "vllm"})
        assert (detail["backend"], detail["effective_backend"]) == ("vllm", "vllm")
        started = _call(v1_server, "POST", f"/models/{model.id}/load")
        job = _wait_job(v1_server, started["job"]["id"])
        assert job["status"] == "succeeded", job
        assert Model.objects.get(pk=model.id).status == "loaded"
    settings.MILLM_BACKEND = "vllm"
    hf = Engine()
    hf.load_model(LoadModelJob("tiny-llama", str(tiny_assets.models["tiny-llama"].path), dtype="float32", device="cpu"))
    yield hf
    hf.shutdown()
    # the next module's tests get the transformers backend again
    v1_server.engine.unload_model()
    for name, value in saved.items():
        setattr(settings, name, value)


@pytest.fixture
def vllm_llama(on_vllm, v1_server):
    """The vLLM-resident model, the L1 SAE attached through /api; yields (server, relu)."""
    from registry.models import SAE

    model_resident(v1_server, "tiny-llama")
    assert v1_server.engine.status().backend == "vllm"
    relu = SAE.objects.get(name="tiny-llama-L1-relu")
    _call(v1_server, "POST", f"/saes/{relu.id}/attach", {"layer": 1})
    v1_server.wait_idle()
    yield v1_server, relu
    v1_server.wait_idle()


def ref(hf: Engine, relu, *, steering: dict[int, float] | None = None, controls=(), monitor=None, prompt: str = PROMPT):
    """The transformers backend's greedy run of ``prompt`` under the same spec (the SAE
    attached under this test's id: each test registers its rows afresh)."""
    hf.detach(None)
    hf.attach(AttachSpec(relu.id, relu.local_path, 1, layout=relu.format or None))
    spec = SteeringSpec([SteeringEntry(relu.id, 1, steering or {}, list(controls))]) if steering or controls else None
    return hf.generate_sync(
        GenerationJob(
            request_id="ref",
            prompt=prompt,
            steering=spec,
            monitor=MonitorSpec(monitor) if monitor else None,
            sampling=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
        ),
        timeout_s=60,
    )


def steered_header(description: str, relu, features: dict[int, float]) -> str:
    """X-miLLM-Steering of a steered answer: its description and the canonical hash."""
    spec = SteeringSpec([SteeringEntry(relu.id, 1, features)])
    return f'{description};hash="{spec.canonical_hash()}"'


def complete(client, **extra):
    body = {
        k: extra.pop(k)
        for k in ("steering", "return_sae_activations", "steering_intensity", "profile", "capture")
        if k in extra
    }
    return client.completions.with_raw_response.create(
        model=extra.pop("model", "tiny-llama"),
        prompt=extra.pop("prompt", PROMPT),
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, **body},
        **extra,
    )


def test_the_api_shows_the_vllm_backend_and_greedy_equals_transformers(vllm_llama, on_vllm, openai_client):
    server, relu = vllm_llama
    health = _call(server, "GET", "/health/inference")
    assert health["backend"] == "vllm"
    caps = health["capabilities"]
    assert caps["per_request_steering"] and caps["per_request_monitoring"]
    assert caps["serial_mode"] is False and caps["batched_mode"] is True
    assert caps["embeddings"] is False and caps["cuda_graphs"] is False
    assert {b["name"]: b["available"] for b in health["backends"]}["vllm"] is True
    # /v1/capabilities says the same (one builder), graphs off as VLLM_ENFORCE_EAGER loads it
    (entry,) = [e for e in request(server.base_url, "GET", "/capabilities").json()["data"] if e["id"] == "tiny-llama"]
    assert (entry["resident"], entry["backend"], entry["mode"]) == (True, "vllm", health["mode"])
    assert entry["capabilities"] == caps and entry["capabilities"]["cuda_graphs"] is False
    assert entry["limits"]["max_concurrent_requests"] == health["max_concurrent_requests"]

    want = ref(on_vllm, relu)
    raw = complete(openai_client)
    assert raw.headers["x-millm-backend"] == "vllm"
    assert raw.headers["x-millm-steering"] == "none"
    out = raw.parse()
    assert out.choices[0].text == want.text
    assert out.usage.completion_tokens == len(want.token_ids) == TOKENS
    # streamed, the same text
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    # the engine ran it on vLLM: the batch stepped
    assert server.engine._scheduler.backend.steps > 0


def test_inline_steering_equals_transformers_and_changes_the_output(vllm_llama, on_vllm, openai_client):
    server, relu = vllm_llama
    features = [{"index": k, "strength": v} for k, v in FEATURES.items()]
    raw = complete(openai_client, steering={"features": features})
    assert raw.headers["x-millm-steering"] == steered_header(f"inline;sae={relu.id};layer=1;features=2", relu, FEATURES)
    assert raw.headers["x-millm-backend"] == "vllm"
    body = raw.parse()
    steered = ref(on_vllm, relu, steering=FEATURES)
    assert steered.text != ref(on_vllm, relu).text  # positive control on the reference
    assert body.choices[0].text == steered.text
    # the delta was added in every forward pass (a hook that did not run reports fewer)
    millm = body.model_extra["millm"]
    assert millm["steering_apply_count"] == [
        {"sae_id": relu.id, "layer": 1, "count": steered.forward_passes, "modes": {"add": steered.forward_passes}}
    ]
    # a steered and an unsteered request, concurrently in one vLLM batch, each its own
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(complete, openai_client)
        again = pool.submit(complete, openai_client, steering={"features": features})
        assert plain.result().parse().choices[0].text == ref(on_vllm, relu).text
        assert again.result().parse().choices[0].text == steered.text


def test_a_clamp_control_steers_like_transformers(vllm_llama, on_vllm, openai_client):
    """A clamp (and a completion-phase ablate beside it) through /v1 on vLLM: the text is
    the transformers backend's under the same spec, which differs from the unsteered text;
    the response counts each mode once per forward pass and names the spec's hash."""
    from gpu_engine.api.protocol import FeatureControl

    server, relu = vllm_llama
    features = [{"index": 3, "mode": "clamp", "value": 9.0}, {"index": 40, "mode": "ablate", "phase": "completion"}]
    controls = [FeatureControl(3, mode="clamp", value=9.0), FeatureControl(40, mode="ablate", phase="completion")]
    raw = complete(openai_client, steering={"features": features})
    assert raw.headers["x-millm-backend"] == "vllm"
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {}, controls)])
    assert raw.headers["x-millm-steering"] == (
        f'inline;sae={relu.id};layer=1;features=2;controls=2;hash="{spec.canonical_hash()}"'
    )
    body = raw.parse()
    want = ref(on_vllm, relu, controls=controls)
    assert want.text != ref(on_vllm, relu).text  # positive control on the reference
    assert body.choices[0].text == want.text
    n = want.forward_passes
    assert body.model_extra["millm"]["steering_apply_count"] == [
        {"sae_id": relu.id, "layer": 1, "count": n, "modes": {"clamp": n, "ablate": n}}
    ]
    # the same controls set as live steering (accepted: vLLM reports steering_controls)
    _call(server, "POST", "/saes/steering/batch", {"controls": features})
    try:
        live = complete(openai_client)
        assert live.headers["x-millm-steering"].startswith("live;")
        assert live.headers["x-millm-steering"].endswith(f'hash="{spec.canonical_hash()}"')
        assert live.parse().choices[0].text == want.text
    finally:
        _call(server, "DELETE", "/saes/steering")
    assert complete(openai_client).parse().choices[0].text == ref(on_vllm, relu).text


def test_sae_activations_and_monitoring_records(vllm_llama, on_vllm, openai_client):
    from monitoring.models import ActivationRecord

    server, relu = vllm_llama
    asked = {"top_k": 4, "features": [3, 7], "positions": "all"}
    raw = complete(openai_client, steering={"features": [{"index": 3, "strength": 8.0}]}, return_sae_activations=asked)
    acts = raw.parse().model_extra["millm"]["sae_activations"]
    want = ref(
        on_vllm, relu, steering={3: 8.0}, monitor=[MonitorEntry(relu.id, 1, top_k=4, features=[3, 7], positions="all")]
    )
    assert (acts["sae_id"], acts["layer"], acts["read_point"]) == (relu.id, 1, "post_steering")
    got = {row["position"]: row for row in acts["positions"]}
    assert sorted(got) == [r.position for r in want.activations]  # one record per position
    for rec in want.activations:
        row = got[rec.position]
        assert [a["feature_index"] for a in row["features"]] == [3, 7]
        assert [a["activation"] for a in row["features"]] == pytest.approx(
            [a.activation for a in rec.features], abs=VLLM_ACT_ATOL
        )
        assert sorted(a["activation"] for a in row["top_k"]) == pytest.approx(
            sorted(a.activation for a in rec.top_k), abs=VLLM_ACT_ATOL
        )

    # monitoring armed through /api: records of /v1 generations, per request, in the database
    _call(
        server,
        "POST",
        "/monitoring/configure",
        {"features": [3, 17, 40], "top_k": 4, "history_size": 500, "positions": "completion"},
    )
    out = complete(openai_client).parse()
    assert out.choices[0].text == ref(on_vllm, relu).text  # monitoring changes no token
    want = ref(
        on_vllm,
        relu,
        monitor=[
            MonitorEntry(relu.id, 1, top_k=4, features=[3, 17, 40], read_point="pre_steering", positions="completion")
        ],
    )
    rows = list(ActivationRecord.objects.filter(request_id=out.id).order_by("token_position"))
    assert [r.token_position for r in rows] == [r.position for r in want.activations]
    for row, expected in zip(rows, want.activations, strict=True):
        assert [p["feature_index"] for p in row.activations] == [3, 17, 40]
        assert [p["activation"] for p in row.activations] == pytest.approx(
            [a.activation for a in expected.features], abs=VLLM_ACT_ATOL
        )


def test_a_profile_and_live_steering_steer_on_vllm(vllm_llama, on_vllm, openai_client):
    from steering.services import profile_create

    server, relu = vllm_llama
    profile_create(
        name="sea-lover",
        sae_id=relu.id,
        layer=1,
        steering={str(k): v for k, v in FEATURES.items()},
        model_name="tiny-llama",
    )
    raw = complete(openai_client, model="tiny-llama@sea-lover")
    assert raw.headers["x-millm-steering"] == steered_header("profile;name=sea-lover;intensity=1", relu, FEATURES)
    want = ref(on_vllm, relu, steering=FEATURES)
    assert raw.parse().choices[0].text == want.text
    half = complete(openai_client, profile="sea-lover", steering_intensity=0.5).parse()
    assert half.choices[0].text == ref(on_vllm, relu, steering={k: v * 0.5 for k, v in FEATURES.items()}).text

    _call(server, "POST", "/saes/steering/batch", {"steering": {"3": 12, "40": -6.5}})
    live = complete(openai_client)
    assert live.headers["x-millm-steering"] == steered_header(f"live;sae={relu.id};layer=1;features=2", relu, FEATURES)
    assert live.parse().choices[0].text == want.text
    opted_out = complete(openai_client, steering={"features": []}).parse()
    assert opted_out.choices[0].text == ref(on_vllm, relu).text != want.text
    _call(server, "POST", "/saes/steering/disable")
    assert complete(openai_client).parse().choices[0].text == ref(on_vllm, relu).text


def test_capture_on_vllm_is_stored_and_equals_transformers(vllm_llama, on_vllm, openai_client, settings):
    """``capture`` through /v1 on vLLM: a steered request's hidden states and Q/K, stored
    (a ``Capture`` row naming the vllm backend) and downloaded, equal the transformers
    backend's capture of the same steered request within the vLLM-vs-transformers bound."""
    import numpy as np

    from gpu_engine.api.artifacts import load_capture
    from gpu_engine.api.protocol import AttentionCaptureSpec, CaptureSpec
    from monitoring.models import Capture

    server, relu = vllm_llama
    settings.CAPTURE_INLINE_MAX_BYTES = 0
    features = [{"index": k, "strength": v} for k, v in FEATURES.items()]
    capture = {
        "layers": [1, 2],
        "positions": "all",
        "attention": {"layers": [2], "positions": "prompt", "q_positions": "last_prompt"},
    }
    body = complete(openai_client, steering={"features": features}, capture=capture).parse()
    cap_obj = body.model_extra["millm"]["capture"]
    assert cap_obj["inline"] is False
    row = Capture.objects.get(id=cap_obj["id"])
    assert row.backend == "vllm" and row.layers == [1, 2]
    dl = request(server.url, "GET", cap_obj["url"])
    assert dl.status == 200
    got = load_capture(dl.body)
    assert (
        got.meta["backend"] == "vllm"
        and got.meta["steering_hash"] == SteeringSpec([SteeringEntry(relu.id, 1, FEATURES)]).canonical_hash()
    )
    on_vllm.detach(None)
    on_vllm.attach(AttachSpec(relu.id, relu.local_path, 1, layout=relu.format or None))
    want = load_capture(
        on_vllm.generate_sync(
            GenerationJob(
                "ref",
                prompt=PROMPT,
                steering=SteeringSpec([SteeringEntry(relu.id, 1, FEATURES)]),
                capture=CaptureSpec(
                    layers=[1, 2],
                    positions="all",
                    attention=AttentionCaptureSpec(layers=[2], positions="prompt", q_positions="last_prompt"),
                ),
                sampling=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
            ),
            timeout_s=60,
        ).capture.data
    )
    assert got.meta["completion_token_ids"] == want.meta["completion_token_ids"]
    assert got.positions.tolist() == want.positions.tolist()
    for layer in (1, 2):
        np.testing.assert_allclose(got.hidden[layer], want.hidden[layer], atol=VLLM_ACT_ATOL, rtol=0)
    np.testing.assert_allclose(got.q[2], want.q[2], atol=VLLM_ACT_ATOL, rtol=0)
    np.testing.assert_allclose(got.k[2], want.k[2], atol=VLLM_ACT_ATOL, rtol=0)


def test_what_vllm_cannot_do_is_a_400_before_anything_runs(vllm_llama, openai_client):
    server, _ = vllm_llama
    batch = server.engine._scheduler.backend
    steps = batch.steps
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model="tiny-llama", input=["the sea"])
    assert err.value.status_code == 400
    assert err.value.code == "invalid_parameter"
    assert "vllm" in err.value.message
    raw = request(server.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": "x"})
    assert_openai_error(raw, 400, "invalid_parameter")
    assert batch.steps == steps and server.engine.status().in_flight == 0


def test_scoring_mode_on_vllm_equals_a_plain_forward(vllm_llama, on_vllm):
    """/v1/completions with ``allowed_token_ids`` on vLLM — 200 ids, more than one vLLM
    request carries — answers each id's probability normalised over the set after the
    temperature, as the test computes it from a float32 forward of the same checkpoint;
    the text is the most probable id's."""
    server, _ = vllm_llama
    ids = on_vllm.backend.encode_text(PROMPT)
    allowed = [int(t) for t in np.random.default_rng(1).permutation(on_vllm.backend.vocab_size)[:200]]
    with torch.inference_mode():
        logits = on_vllm.backend.model(torch.tensor([ids])).logits[0, -1].double()
    scaled = logits[allowed] / 0.5
    want = dict(zip(allowed, (scaled - torch.logsumexp(scaled, 0)).tolist()))
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.5,
        "logprobs": 1,
        "allowed_token_ids": allowed,
        "return_tokens_as_token_ids": True,
    }
    raw = request(server.base_url, "POST", "/completions", body, timeout=300)
    assert raw.status == 200, raw.body[:300]
    assert raw.headers["x-millm-backend"] == "vllm"
    (choice,) = raw.json()["choices"]
    got = {int(k.removeprefix("token_id:")): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
    assert got == pytest.approx(want, abs=1e-4)
    best = max(want, key=want.get)
    assert choice["text"] == on_vllm.backend.token_text(best)
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(want[best], abs=1e-4)


def test_response_format_on_vllm_parses_and_validates(vllm_llama, openai_client):
    """tiny-llama's random weights write JSON only under the grammar vLLM enforces;
    ``jsonschema`` checks it. Its chat template ignores tools: refused by name."""
    import json

    import jsonschema

    from tests.v1.test_structured import FORMAT, MESSAGES, SCHEMA

    server, _ = vllm_llama
    caps = server.engine.status().batching["capabilities"]
    assert caps["structured_output"] is True and caps["tool_calling"] is False
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=120, temperature=0, response_format=FORMAT
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=5, n=2, response_format=FORMAT
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    free = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    resp = request(
        server.base_url,
        "POST",
        "/chat/completions",
        {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2, "tools": tools},
    )
    assert_openai_error(resp, 400, "field_not_honoured", "tools")


# ---------------------------------------------------------------- slots (issue 33, item 4)


@contextlib.contextmanager
def held_batch(server, rows: int):
    """Hold the engine's vLLM batch once one of its steps has run ``rows`` rows at once.

    The first step waits until the engine has accepted ``rows`` generations (so a request
    that reached it late does not miss the batch on a slow host: an event, not a margin);
    the step after which ``rows`` sequences are running sets ``full`` and blocks until the
    test sets ``go`` (on leaving the block at the latest). Yields (full, go)."""
    engine = server.engine
    batch = engine._scheduler.backend
    step = batch.step
    full, go = threading.Event(), threading.Event()
    first = [True]

    def gated():
        if first[0]:
            first[0] = False
            deadline = time.monotonic() + 120
            while engine._ledger.live() < rows and time.monotonic() < deadline and not go.is_set():
                time.sleep(0.005)
        finished = step()
        if not full.is_set() and len(engine._scheduler.running) >= rows:
            full.set()
            go.wait(300)
        return finished

    batch.step = gated
    try:
        yield full, go
    finally:
        go.set()
        del batch.step


def test_slots_follow_vllm_max_num_seqs_when_max_concurrent_requests_is_unset(vllm_llama, on_vllm, openai_client):
    """MAX_CONCURRENT_REQUESTS unset: a model on vLLM gets VLLM_MAX_NUM_SEQS slots, and that
    many concurrent /v1 requests are all admitted and share vLLM's steps."""
    from django.conf import settings

    server, relu = vllm_llama
    assert settings.MAX_CONCURRENT_REQUESTS == 0  # the default: follow the backend
    n = settings.VLLM_MAX_NUM_SEQS  # 8, the fixture's
    health = _call(server, "GET", "/health/inference")
    assert health["max_concurrent_requests"] == n
    assert health["slots"] == {
        "slots": n,
        "source": "VLLM_MAX_NUM_SEQS",
        "backend": "vllm",
        "follows_backend": True,
        "max_concurrent_requests": 0,
    }
    assert health["batching"]["max_batch_size"] == n  # the engine's rows follow it too
    want = ref(on_vllm, relu).text
    steps_before = health["batching"]["decode_steps"]
    with held_batch(server, n) as (full, go), concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(complete, openai_client) for _ in range(n)]
        assert full.wait(300), "the n requests never ran in one vLLM step"
        # held with all n running: every one holds a slot, none waits
        inference = _call(server, "GET", "/health/detailed")["inference"]
        assert (inference["slots"], inference["in_flight"], inference["waiting"]) == (n, n, 0)
        assert inference["slots_source"] == "VLLM_MAX_NUM_SEQS"
        batching = _call(server, "GET", "/health/inference")["batching"]
        assert (batching["running"], batching["waiting"]) == (n, 0)
        go.set()
        outs = [f.result(timeout=300).parse() for f in futures]
    assert [o.choices[0].text for o in outs] == [want] * n
    # they shared vLLM's steps: one after another they would take n × TOKENS steps
    steps = _call(server, "GET", "/health/inference")["batching"]["decode_steps"] - steps_before
    assert TOKENS <= steps < n * TOKENS // 2


def test_max_concurrent_requests_set_caps_the_slots_on_vllm(vllm_llama, on_vllm, openai_client, settings):
    """MAX_CONCURRENT_REQUESTS=2 set: two requests run at once on vLLM, the third waits in
    /v1's queue for a slot and then runs."""
    server, relu = vllm_llama
    settings.MAX_CONCURRENT_REQUESTS = 2
    health = _call(server, "GET", "/health/inference")
    assert health["max_concurrent_requests"] == 2
    assert health["slots"]["source"] == "MAX_CONCURRENT_REQUESTS"
    want = ref(on_vllm, relu).text
    with held_batch(server, 2) as (full, go), concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(complete, openai_client) for _ in range(3)]
        assert full.wait(300)
        deadline = time.monotonic() + 60
        while (inference := _call(server, "GET", "/health/detailed")["inference"])["waiting"] < 1:
            assert time.monotonic() < deadline, inference
            time.sleep(0.02)
        assert (inference["slots"], inference["in_flight"], inference["waiting"]) == (2, 2, 1)
        assert inference["slots_source"] == "MAX_CONCURRENT_REQUESTS"
        assert _call(server, "GET", "/health/inference")["batching"]["running"] == 2
        go.set()
        outs = [f.result(timeout=300).parse() for f in futures]
    assert [o.choices[0].text for o in outs] == [want] * 3
    inference = _call(server, "GET", "/health/detailed")["inference"]
    assert (inference["in_flight"], inference["waiting"]) == (0, 0)
