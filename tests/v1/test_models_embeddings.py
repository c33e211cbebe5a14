"""/v1/models, /v1/embeddings, and models loaded on demand (single-flight) or refused
under ``X-miLLM-Load-Policy: refuse``."""

from __future__ import annotations

import base64
import struct
import threading
import time

import openai
import pytest

from core.runtime import runtime
from gpu_engine.api.protocol import EmbedJob
from registry.models import Model
from tests.v1.conftest import attach
from tests.v1.helpers import assert_openai_error, request


def test_models_list_and_detail(llama, openai_client):
    ids = [m.id for m in openai_client.models.list().data]
    assert {"tiny-llama", "tiny-gemma2", "tiny-gpt2"} <= set(ids)
    card = openai_client.models.retrieve("tiny-llama")
    assert card.id == "tiny-llama" and card.object == "model" and card.owned_by == "local"
    assert card.created == int(Model.objects.get(name="tiny-llama").created_at.timestamp())
    # a model locked for steering is the only one listed
    attach("tiny-llama-L1-relu", 1)
    assert [m.id for m in openai_client.models.list().data] == ["tiny-llama"]


def test_models_list_each_profile_as_a_model_variant(llama, openai_client):
    """Chat clients that only pick a model (Open WebUI) pick a profile as <model>@<profile>."""
    from steering.models import Profile

    Profile.objects.create(name="sea", model_name="tiny-llama")
    Profile.objects.create(name="anywhere")  # made for any model
    Profile.objects.create(name="gemma-only", model_name="tiny-gemma2")
    ids = [m.id for m in openai_client.models.list().data]
    assert ids[ids.index("tiny-llama") + 1 : ids.index("tiny-llama") + 3] == ["tiny-llama@anywhere", "tiny-llama@sea"]
    assert "tiny-gemma2@gemma-only" in ids and "tiny-llama@gemma-only" not in ids
    card = openai_client.models.retrieve("tiny-llama@sea")
    assert card.id == "tiny-llama@sea" and card.owned_by == "local"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("tiny-llama@gemma-only")
    # a listed variant is servable as it is listed (an empty profile steers nothing)
    out = openai_client.chat.completions.with_raw_response.create(
        model="tiny-llama@anywhere", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.status_code == 200 and out.parse().model == "tiny-llama"
    assert out.headers["x-millm-steering"] == "none"


def test_embeddings_equal_the_engine_and_are_never_steered(llama, openai_client):
    texts = ["the sea", "a sky full of stars"]
    out = openai_client.embeddings.create(model="tiny-llama", input=texts)
    ref = llama.engine.embed(EmbedJob("ref", inputs=texts))
    assert [d.index for d in out.data] == [0, 1]
    for got, exp in zip(out.data, ref.embeddings):
        assert got.embedding == pytest.approx(exp, abs=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens == ref.usage.prompt_tokens
    raw = request(
        llama.base_url,
        "POST",
        "/embeddings",
        {"model": "tiny-llama", "input": [[5, 6, 7]], "encoding_format": "base64"},
    )
    vector = base64.b64decode(raw.json()["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(vector) // 4}f", vector)
    exp = llama.engine.embed(EmbedJob("ref", inputs=[[5, 6, 7]])).embeddings[0]
    assert list(floats) == pytest.approx(exp, abs=1e-6)
    assert raw.headers["x-millm-steering"] == "none"
    attach("tiny-llama-L1-relu", 1)  # an attached SAE changes nothing
    again = openai_client.embeddings.create(model="tiny-llama", input=texts)
    assert again.data[0].embedding == pytest.approx(out.data[0].embedding, abs=1e-7)
    assert_openai_error(
        request(llama.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": ""}), 400, "invalid_parameter"
    )
    assert_openai_error(
        request(llama.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": "x", "dimensions": 8}),
        400,
        "field_not_honoured",
        "dimensions",
    )


def test_dimensions_equal_to_the_models_own_size_pass(llama, openai_client, tiny_assets):
    """The neutral value of ``dimensions`` (docs/api-v1.md, request policy): the model's
    hidden size, read here from the checkpoint's config, gives the usual embedding; any
    other size is refused — before anything loads when the model is not resident."""
    import json

    def hidden(name: str) -> int:
        cfg = json.loads((tiny_assets.models[name].path / "config.json").read_text())
        return int(cfg.get("hidden_size") or cfg["n_embd"])

    size = hidden("tiny-llama")
    plain = openai_client.embeddings.create(model="tiny-llama", input="the sea")
    same = openai_client.embeddings.create(model="tiny-llama", input="the sea", dimensions=size)
    assert len(same.data[0].embedding) == size
    assert same.data[0].embedding == pytest.approx(plain.data[0].embedding, abs=1e-7)
    for model, asked in (("tiny-llama", size - 1), ("tiny-gpt2", hidden("tiny-gpt2") + 1)):
        assert_openai_error(
            request(llama.base_url, "POST", "/embeddings", {"model": model, "input": "x", "dimensions": asked}),
            400,
            "field_not_honoured",
            "dimensions",
        )
    assert llama.engine.status().model_id == "tiny-llama"  # tiny-gpt2 was never loaded
    # the size of a model that is not resident, when it is what that model gives: loaded
    gpt2 = request(
        llama.base_url, "POST", "/embeddings", {"model": "tiny-gpt2", "input": "x", "dimensions": hidden("tiny-gpt2")}
    )
    assert gpt2.status == 200, gpt2.body[:300]
    assert len(gpt2.json()["data"][0]["embedding"]) == hidden("tiny-gpt2")


def test_a_registered_model_is_loaded_on_demand_once(llama, openai_client, monkeypatch):
    client = llama.client
    calls: list[str] = []
    real_load = client.load_model

    def slow_load(job, **kwargs):
        calls.append(job.model_id)
        time.sleep(2.0)  # long enough to ask questions while it runs, on a busy machine
        return real_load(job, **kwargs)

    monkeypatch.setattr(client, "load_model", slow_load)
    refuse = {"X-miLLM-Load-Policy": "refuse"}
    body = {"model": "tiny-gpt2", "prompt": "the sea", "max_tokens": 3}
    resp = request(llama.base_url, "POST", "/completions", body, headers=refuse)
    assert_openai_error(resp, 409, "model_not_resident")
    with pytest.raises(openai.ConflictError):
        openai_client.completions.create(**body, extra_headers=refuse)

    from inference.admission import AdmissionController

    with runtime().replaced(admission=AdmissionController(slots=2, max_pending=4)):
        results: list[int] = []
        bodies: list[bytes] = []

        def call() -> None:
            resp = request(llama.base_url, "POST", "/completions", body)
            results.append(resp.status)
            bodies.append(resp.body)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while not runtime().residency.loading("tiny-gpt2") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime().residency.loading("tiny-gpt2")
        during = request(llama.base_url, "POST", "/completions", body, headers=refuse)
        assert_openai_error(during, 503, "model_loading")
        assert during.headers["retry-after"] == "15"  # RETRY_AFTER_LOAD_S
        other = request(llama.base_url, "POST", "/completions", {**body, "model": "tiny-gemma2"})
        assert_openai_error(other, 503, "model_busy")
        for t in threads:
            t.join(60)
    assert results == [200, 200], bodies
    assert calls == ["tiny-gpt2"]  # one load for both requests
    assert llama.engine.status().model_id == "tiny-gpt2"
    assert Model.objects.get(name="tiny-gpt2").status == Model.Status.LOADED
    ok = request(llama.base_url, "POST", "/completions", body, headers=refuse)
    assert ok.status == 200


def test_a_locked_model_is_not_swapped_by_a_request(llama):
    attach("tiny-llama-L1-relu", 1)
    resp = request(llama.base_url, "POST", "/completions", {"model": "tiny-gpt2", "prompt": "x", "max_tokens": 2})
    assert_openai_error(resp, 409, "model_locked")
    assert llama.engine.status().model_id == "tiny-llama"
