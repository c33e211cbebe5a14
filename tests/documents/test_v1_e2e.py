"""End to end over a real socket: what /api sets is what /v1 runs.

- a profile activated through /api changes /v1 greedy output exactly as the same inline
  steering does (and differs from unsteered: the positive control);
- live steering is the default of requests that bring none, ``features: []`` opts out;
- monitoring records come from /v1 generations, each attributed to the request that made
  it, equal to the engine's own pre-steering read, and arming it changes no token;
- a lease blocks /v1 auto-loading another model for anyone without ``X-miLLM-Lease``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest

from gpu_engine.api.protocol import (
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from leases.models import Lease
from monitoring.models import ActivationRecord
from tests.documents.conftest import make_resident, register_llama
from tests.v1.helpers import assert_openai_error, request

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "the sea and the sky"
FEATURES = {3: 12.0, 40: -6.5}


@dataclass
class Served:
    url: str
    engine: Any
    saes: dict[str, Any]
    model: Any

    def api(self, method: str, path: str, body: Any = None, **kwargs):
        return request(self.url + "/api", method, path, body, **kwargs)

    def v1(self, body: dict, **kwargs):
        return request(
            self.url + "/v1",
            "POST",
            "/completions",
            {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **body},
            **kwargs,
        )

    def direct(self, steering=None, monitor=None, prompt=PROMPT):
        return self.engine.engine.generate_sync(
            GenerationJob(
                request_id="ref",
                prompt=prompt,
                steering=steering,
                monitor=monitor,
                sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
            ),
            timeout_s=60,
        )


@pytest.fixture
def served(engine, tiny_assets, transactional_db):
    from tests.v1.live_server import live_server

    model, saes = register_llama(tiny_assets)
    make_resident(engine, model)
    server = live_server()
    return Served(server.url, engine, saes, model)


@pytest.fixture
def relu(served):
    from orchestration.services import sae_attach

    sae = served.saes["tiny-llama-L1-relu"]
    sae_attach(sae=sae, layer=1)
    return sae


def _text(resp) -> str:
    assert resp.status == 200, resp.body[:400]
    return resp.json()["choices"][0]["text"]


def test_a_profile_activated_through_the_api_steers_v1_like_inline_steering(served, relu):
    plain = served.direct().text
    created = served.api("POST", "/profiles", {"name": "sea", "steering": {str(k): v for k, v in FEATURES.items()}})
    assert created.status == 201, created.body
    profile_id = created.json()["data"]["id"]
    assert served.api("POST", f"/profiles/{profile_id}/activate").status == 200

    by_profile = served.v1({})
    inline = served.v1({"steering": {"features": [{"index": k, "strength": v} for k, v in FEATURES.items()]}})
    assert _text(by_profile) == _text(inline)
    assert _text(by_profile) != plain  # positive control: the steer changes the output
    assert _text(by_profile) == served.direct(SteeringSpec([SteeringEntry(relu.id, 1, FEATURES)])).text
    spec = SteeringSpec([SteeringEntry(relu.id, 1, FEATURES)])
    assert by_profile.headers["x-millm-steering"] == (
        f'live;sae={relu.id};layer=1;features=2;hash="{spec.canonical_hash()}"'
    )
    # a request can still opt out, or dial the live steering for itself
    assert _text(served.v1({"steering": {"features": []}})) == plain
    dialled = served.v1({"steering_intensity": 0.5, "logprobs": 0})
    assert ';intensity=0.5;hash="sha256:' in dialled.headers["x-millm-steering"]
    assert (
        _text(dialled)
        == served.direct(SteeringSpec([SteeringEntry(relu.id, 1, {k: v * 0.5 for k, v in FEATURES.items()})])).text
    )
    assert dialled.json()["millm"]["steering"]["mode"] == "live"

    assert served.api("POST", f"/profiles/{profile_id}/deactivate").status == 200
    after = served.v1({})
    assert _text(after) == plain and after.headers["x-millm-steering"] == "none"


def test_live_steering_set_directly_is_the_default(served, relu):
    assert served.api("POST", "/saes/steering/batch", {"steering": {"3": 12, "40": -6.5}}).status == 200
    assert _text(served.v1({})) == served.direct(SteeringSpec([SteeringEntry(relu.id, 1, FEATURES)])).text
    assert served.api("POST", "/saes/steering/disable").status == 200
    assert _text(served.v1({})) == served.direct().text
    assert served.api("POST", "/saes/steering/enable").status == 200
    assert served.api("DELETE", "/saes/steering/40").status == 200
    assert _text(served.v1({})) == served.direct(SteeringSpec([SteeringEntry(relu.id, 1, {3: 12.0})])).text


def test_monitoring_records_come_from_v1_attributed_per_request(served, relu):
    prompts = [PROMPT, "a small red boat"]
    unmonitored = [_text(served.v1({"prompt": p})) for p in prompts]
    configured = served.api(
        "POST",
        "/monitoring/configure",
        {"features": [3, 17, 40], "top_k": 4, "history_size": 500, "positions": "completion"},
    )
    assert configured.status == 200, configured.body
    assert served.api("POST", "/saes/steering", {"feature_idx": 3, "value": 8}).status == 200
    steer = SteeringSpec([SteeringEntry(relu.id, 1, {3: 8.0})])

    answers: list[Any] = [None, None]

    def run(i):
        answers[i] = served.v1({"prompt": prompts[i]})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    entry = MonitorEntry(
        sae_id=relu.id, layer=1, top_k=4, features=[3, 17, 40], read_point="pre_steering", positions="completion"
    )
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.status == 200, answer.body
        body = answer.json()
        ref = served.direct(steer, MonitorSpec([entry]), prompt=prompt)
        assert body["choices"][0]["text"] == ref.text
        assert "millm" not in body  # monitoring is not the request's own extension
        rows = list(ActivationRecord.objects.filter(request_id=body["id"]).order_by("token_position"))
        assert [r.token_position for r in rows] == [r.position for r in ref.activations]
        for row, expected in zip(rows, ref.activations, strict=True):
            assert [p["feature_index"] for p in row.activations] == [3, 17, 40]
            assert [p["activation"] for p in row.activations] == pytest.approx(
                [a.activation for a in expected.features], abs=1e-6
            )
            assert [p["feature_index"] for p in row.top_k] == [a.feature_index for a in expected.top_k]
    assert ActivationRecord.objects.values("request_id").distinct().count() == 2
    history = served.api("GET", f"/monitoring/history?request_id={answers[1].json()['id']}")
    assert history.json()["data"]["total"] == 16

    # arming monitoring changes no token; the request's own read stays its own
    served.api("DELETE", "/saes/steering")
    assert [_text(served.v1({"prompt": p})) for p in prompts] == unmonitored
    own = served.v1({"return_sae_activations": {"features": [3], "top_k": 2, "read_point": "pre_steering"}})
    assert own.status == 200
    assert not ActivationRecord.objects.filter(request_id=own.json()["id"]).exists()
    mixed = served.v1({"return_sae_activations": {"features": [3], "top_k": 2}})
    positions = mixed.json()["millm"]["sae_activations"]["positions"]
    assert len(positions) == 16 and mixed.json()["millm"]["sae_activations"]["read_point"] == "post_steering"
    assert ActivationRecord.objects.filter(request_id=mixed.json()["id"]).count() == 16
    # streamed: recorded before the last chunk leaves, under the chunks' id
    streamed = served.v1({"stream": True})
    events = streamed.events()
    assert events[-1] == "[DONE]"
    stream_id = events[0]["id"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == unmonitored[0]
    assert ActivationRecord.objects.filter(request_id=stream_id).count() == 16


def test_a_lease_blocks_v1_auto_load_for_others(served, tiny_assets):
    from registry.services import model_register_local

    model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    granted = served.api(
        "POST", f"/models/{served.model.id}/lease", {"holder": "evaluator", "reason": "a long run", "ttl_seconds": 60}
    )
    assert granted.status == 201
    lease_id = granted.json()["data"]["lease_id"]
    other = {"model": "tiny-gpt2", "prompt": "x", "max_tokens": 2}
    error = assert_openai_error(served.v1(other), 409, "model_leased")
    assert error["type"] == "invalid_request_error"
    assert_openai_error(served.v1(other, headers={"X-miLLM-Lease": "lease_nope"}), 409, "model_leased")
    assert_openai_error(served.v1(other, headers={"X-miLLM-Load-Policy": "refuse"}), 409, "model_not_resident")
    assert served.engine.status().model_id == "tiny-llama"
    # using the leased model needs nothing
    assert served.v1({}).status == 200
    # its holder may swap it; the lease ends with the model
    swapped = served.v1(other, headers={"X-miLLM-Lease": lease_id})
    assert swapped.status == 200, swapped.body
    assert served.engine.status().model_id == "tiny-gpt2"
    assert Lease.objects.get().end_reason == "model_unloaded"


def test_live_and_profile_controls_run_on_v1_as_the_engine_runs_them(served, relu):
    """A request with no steering of its own runs the live steering's controls, then a
    profile's: exactly the tokens the engine generates for the equivalent spec."""
    from gpu_engine.api.protocol import FeatureControl, PositionRange

    plain = served.direct().text
    controls = [
        {"index": 3, "mode": "clamp", "value": 30.0},
        {"index": 40, "mode": "add", "value": -12.0, "phase": "completion", "window": {"start": 0, "end": 12}},
    ]
    engine_controls = [
        FeatureControl(3, mode="clamp", value=30.0),
        FeatureControl(40, value=-12.0, phase="completion", window=PositionRange(0, 12)),
    ]
    assert served.api("POST", "/saes/steering/batch", {"steering": {"17": 6.0}, "controls": controls}).status == 200
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {17: 6.0}, engine_controls)])
    live = served.v1({})
    want = served.direct(spec).text
    assert _text(live) == want
    assert want != plain  # positive control
    assert want != served.direct(SteeringSpec([SteeringEntry(relu.id, 1, {17: 6.0})])).text
    assert live.headers["x-millm-steering"] == (
        f'live;sae={relu.id};layer=1;features=3;controls=2;hash="{spec.canonical_hash()}"'
    )
    # the dial: adds scaled, the clamp as written
    dialled = served.v1({"steering_intensity": 0.5})
    assert (
        _text(dialled)
        == served.direct(
            SteeringSpec(
                [
                    SteeringEntry(
                        relu.id,
                        1,
                        {17: 3.0},
                        [
                            engine_controls[0],
                            FeatureControl(40, value=-6.0, phase="completion", window=PositionRange(0, 12)),
                        ],
                    )
                ]
            )
        ).text
    )

    # the same through a profile, named by a request and activated
    served.api("DELETE", "/saes/steering")
    assert _text(served.v1({})) == plain
    created = served.api("POST", "/profiles", {"name": "gates", "steering": {"17": 6.0}, "controls": controls})
    assert created.status == 201, created.body
    named = served.v1({"profile": "gates"})
    assert _text(named) == want
    assert named.json()["millm"]["steering"]["hash"] == spec.canonical_hash()
    assert served.api("POST", "/profiles/gates/activate").status == 200
    assert _text(served.v1({})) == want


def test_a_serving_circuit_is_named_in_the_steering_header(served, relu):
    """The original's ``circuit;id=…;intensity=…`` form of X-miLLM-Steering when serving
    circuits set the live steering, with the request's dial as ``;dial=``; the hash is the
    set that ran, equal to the same set sent inline."""
    import json

    doc = {
        "kind": "mistudio.circuit-definition",
        "schema_version": "1",
        "name": "sea-circuit",
        "saes": [{"mistudio_sae_id": relu.id, "layer": 1}],
        "members": [{"layer": 1, "feature": {"feature_idx": 3, "strength": 12.0, "sign": 1}}],
        "edges": [{"up": {"layer": 1, "feature_idx": 3}, "down": {"layer": 1, "feature_idx": 3}, "rung": 2}],
        "budget": {"intensity": 1.5, "intensity_range": [0.25, 2.0]},
    }
    made = served.api(
        "POST", "/circuits/import", raw=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    assert made.status == 201, made.body
    cid = made.json()["data"]["id"]
    assert served.api("POST", f"/circuits/{cid}/activate").status == 200
    resp = served.v1({})
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {3: 18.0})])  # 12 × λ 1.5
    assert _text(resp) == served.direct(spec).text != served.direct().text
    assert resp.headers["x-millm-steering"] == (f'circuit;id={cid};intensity=1.5;hash="{spec.canonical_hash()}"')
    dialled = served.v1({"steering_intensity": 0.5})
    half = SteeringSpec([SteeringEntry(relu.id, 1, {3: 9.0})])
    assert dialled.headers["x-millm-steering"] == (
        f'circuit;id={cid};intensity=1.5;dial=0.5;hash="{half.canonical_hash()}"'
    )
    assert served.api("POST", f"/circuits/{cid}/deactivate").status == 200
    assert served.v1({}).headers["x-millm-steering"] == "none"
    # live steering set directly keeps the live form
    assert served.api("POST", "/saes/steering", {"sae_id": relu.id, "feature_idx": 3, "value": 5.0}).status == 200
    assert served.v1({}).headers["x-millm-steering"].startswith(f"live;sae={relu.id};layer=1;")
