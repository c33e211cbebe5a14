"""``GET /v1/capabilities``: per listed model, what it offers. The resident model's entry
says what ``/api/health/inference`` says (the same engine report), its shape facts are the
checkpoint's own (read here from its config.json), and they change with the backend (the
same weights as a GGUF on llama.cpp); a listed model that is not resident names the
backend it would load on, with ``resident: false`` and no live report. Read like
/v1/models: an inference key may, without a key it is 401."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.v1.conftest import model_resident
from tests.v1.helpers import assert_openai_error, request


def _health(server) -> dict:
    resp = request(server.url, "GET", "/api/health/inference")
    assert resp.status == 200, resp.body[:300]
    return resp.json()["data"]


def _entries(server, headers=None) -> dict[str, dict]:
    resp = request(server.base_url, "GET", "/capabilities", headers=headers)
    assert resp.status == 200, resp.body[:300]
    body = resp.json()
    assert body["object"] == "list"
    return {entry["id"]: entry for entry in body["data"]}


def _assert_agrees_with_health(entry: dict, health: dict) -> None:
    assert entry["resident"] is True
    assert entry["backend"] == health["backend"] and entry["mode"] == health["mode"]
    assert entry["capabilities"] == health["capabilities"]
    limits = entry["limits"]
    assert limits["max_concurrent_requests"] == health["max_concurrent_requests"]
    assert limits["max_pending_requests"] == health["max_pending_requests"]
    batching = health["batching"]
    assert limits["max_batch_rows"] == (batching.get("max_batch_size") if batching.get("enabled") else None)


def test_the_resident_model_says_what_health_says_and_what_its_checkpoint_is(llama, tiny_assets):
    entries = _entries(llama)
    # every model /v1/models lists (its @profile ids aside), and nothing else
    listed = request(llama.base_url, "GET", "/models").json()["data"]
    assert set(entries) == {m["id"] for m in listed if "@" not in m["id"]}
    entry = entries["tiny-llama"]
    _assert_agrees_with_health(entry, _health(llama))
    assert entry["object"] == "model.capabilities" and entry["backend"] == "transformers"
    # the checkpoint's own shape, read apart from the server
    config = json.loads((Path(tiny_assets.models["tiny-llama"].path) / "config.json").read_text())
    assert entry["limits"]["context_length"] == config["max_position_embeddings"]
    assert (entry["num_layers"], entry["hidden_size"]) == (config["num_hidden_layers"], config["hidden_size"])
    caps = entry["capabilities"]
    assert caps["streaming"] is True and caps["per_request_steering"] is True
    assert caps["hook_points"], caps
    assert entry["limits"]["max_n"] == 16 and entry["limits"]["max_steering_features"] == 4096


def test_a_model_that_is_not_resident_names_its_backend_without_a_live_report(llama):
    from registry.models import Model

    entries = _entries(llama)
    others = [e for name, e in entries.items() if name != "tiny-llama"]
    assert others, entries.keys()
    for entry in others:
        row = Model.objects.get(name=entry["id"])
        assert entry["resident"] is False and entry["capabilities"] is None
        assert entry["backend"] == row.effective_backend() and entry["backend_available"] is True
        assert entry["hidden_size"] == row.hidden_size and entry["limits"]["context_length"] == row.context_length
        assert entry["limits"]["max_batch_rows"] is None
    # reading changes nothing the engine holds
    assert llama.engine.status().model_id == "tiny-llama"


@pytest.fixture
def tiny_on_llamacpp(v1_server, tiny_gguf, settings):
    """The tiny Llama's weights as a GGUF, resident on llama.cpp (GGUF: no backend named);
    tiny-llama on transformers again afterwards."""
    from orchestration.services import model_load
    from registry.models import Model
    from registry.services import model_register_local

    settings.LOCAL_MODEL_ROOTS = (*settings.LOCAL_MODEL_ROOTS, str(tiny_gguf.parent))
    row = Model.objects.filter(name="tiny-llama-gguf").first() or model_register_local(
        local_path=str(tiny_gguf), name="tiny-llama-gguf"
    )
    model_load(model=row)
    v1_server.wait_idle()
    yield v1_server
    model_resident(v1_server, "tiny-llama")
    v1_server.wait_idle()


def test_the_facts_change_with_the_backend(llama, tiny_on_llamacpp):
    server = tiny_on_llamacpp
    entries = _entries(server)
    gguf = entries["tiny-llama-gguf"]
    health = _health(server)
    _assert_agrees_with_health(gguf, health)
    assert gguf["backend"] == "llamacpp"
    # the transformers model is now registered, not resident: no live report
    assert entries["tiny-llama"]["resident"] is False and entries["tiny-llama"]["backend"] == "transformers"
    # llama.cpp reports its steering mode; the transformers backend has none
    assert "steering_mode" in gguf["capabilities"]
    model_resident(server, "tiny-llama")
    server.wait_idle()
    back = _entries(server)["tiny-llama"]
    _assert_agrees_with_health(back, _health(server))
    assert "steering_mode" not in back["capabilities"]
    assert back["capabilities"] != gguf["capabilities"]
    assert back["num_layers"] == gguf["num_layers"] and back["hidden_size"] == gguf["hidden_size"]


def test_read_as_v1_models_is(llama, settings):
    settings.MILLM_API_KEYS = ("bob:kb",)
    settings.MILLM_ADMIN_API_KEYS = ("root:kr",)
    bob = _entries(llama, headers={"Authorization": "Bearer kb"})
    root = _entries(llama, headers={"Authorization": "Bearer kr"})
    assert bob == root and bob["tiny-llama"]["resident"] is True
    assert request(llama.base_url, "GET", "/models").status == 401
    anonymous = request(llama.base_url, "GET", "/capabilities")
    assert anonymous.status == 401 and set(anonymous.json()) == {"error"}
    wrong = request(llama.base_url, "GET", "/capabilities", headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    post = request(llama.base_url, "POST", "/capabilities", {}, headers={"Authorization": "Bearer kb"})
    assert_openai_error(post, 405, "method_not_allowed", None)
    assert llama.engine.status().model_id == "tiny-llama"
