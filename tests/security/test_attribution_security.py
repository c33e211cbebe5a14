"""``POST /api/experiments/attribution`` as an attacker sends it (docs/security.md,
"Experiments"), to the live daphne of tests/v1 with tiny-llama resident and its layer-1
SAE attached. An attribution stores nothing, so "nothing happened" is: no backward pass
ran (the test counts the calls of the loaded backend's own ``attribution``, the one
place that runs the forwards and the backward) and the answer is the documented refusal,
never a traceback. The positive controls (an inference key and an admin key are
answered, and the backend's counter moves) show the counter watches the right place."""

from __future__ import annotations

import json
from typing import Any

import pytest

from experiments.attribution import MAX_MESSAGES, MAX_PROMPT_CHARS
from registry.models import SAE
from tests.v1.conftest import KEYS, _v1_db, attach, keyed, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request
from tests.v1.test_vllm_backend import on_vllm, vllm_llama  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)

PATH = "/api/experiments/attribution"
NAME, LAYER = "tiny-llama-L1-relu", 1
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def served(llama, monkeypatch):
    """(server, backward passes): the SAE attached, the backend's attribution counted."""
    attach(NAME, LAYER)
    backend = llama.engine.backend
    calls: list[int] = []
    real = backend.attribution

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "attribution", counted)
    return llama, calls


def sae_id(name: str = NAME) -> str:
    return SAE.objects.get(name=name).id


def post(server, body: Any = None, *, key: str | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
    resp = request(server.url, "POST", PATH, body, raw=raw, headers=headers, timeout=120)
    assert b"Traceback" not in resp.body
    return resp.status, resp.json()


def refused(got: tuple[int, dict], status: int, code: str) -> dict:
    status_got, body = got
    assert status_got == status and body["success"] is False, body
    assert body["error"]["code"] == code, body
    return body["error"]


def test_no_key_or_a_wrong_one_runs_nothing_and_either_kind_of_key_is_answered(served, keyed):
    server, calls = served
    body = {"sae_id": sae_id(), "prompt": PROMPT, "top_n": 3, "ablate_top": 1}
    assert post(server, body)[0] == 401
    resp = request(server.url, "POST", PATH, body, headers={"Authorization": "Bearer sk-nobody-0123456789"})
    assert resp.status == 401
    assert calls == []
    for who in ("alice", "root"):  # an inference key may attribute; so may an admin key
        status, answer = post(server, body, key=who)
        assert status == 200 and answer["data"]["features"], answer
    assert len(calls) == 2


def test_oversize_and_costly_bodies_are_refused_before_any_backward_pass(served):
    server, calls = served
    sid = sae_id()
    big = json.dumps({"sae_id": sid, "prompt": "x" * (10 * 2**20)}).encode()
    refused(post(server, raw=big), 413, "PAYLOAD_TOO_LARGE")

    def field_refused(body: dict, field: str) -> None:
        error = refused(post(server, body), 422, "VALIDATION_ERROR")
        assert field in json.dumps(error["details"]), error

    field_refused({"sae_id": sid, "prompt": "a" * (MAX_PROMPT_CHARS + 1)}, "prompt")
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    field_refused({"sae_id": sid, "messages": many}, "messages")
    long = [{"role": "user", "content": "a" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2
    field_refused({"sae_id": sid, "messages": long}, "messages")
    field_refused({"sae_id": sid, "messages": [{"role": "root", "content": "hi"}]}, "role")
    field_refused({"sae_id": sid, "prompt": PROMPT, "top_n": 101}, "top_n")
    field_refused({"sae_id": sid, "prompt": PROMPT, "ablate_top": 21, "top_n": 50}, "ablate_top")
    field_refused({"sae_id": sid, "prompt": PROMPT, "ablate_top": 4, "top_n": 3}, "ablate_top")
    field_refused({"sae_id": sid}, "prompt")
    field_refused({"sae_id": sid, "prompt": PROMPT, "messages": [{"role": "user", "content": "hi"}]}, "prompt")
    field_refused({"sae_id": sid, "prompt": ""}, "prompt")
    field_refused({"sae_id": sid, "prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt")
    field_refused({"sae_id": sid, "prompt": PROMPT, "stream": True}, "stream")
    field_refused({"sae_id": sid, "prompt": PROMPT, "top_n": "3"}, "top_n")
    # within the characters but past the model's 512-token context: the engine's refusal,
    # before the forward
    error = refused(post(server, {"sae_id": sid, "prompt": "fox " * 2000}), 400, "CONTEXT_LENGTH_EXCEEDED")
    assert "512" in error["message"]
    assert calls == []
    # the positive control: the same route runs a backward for a body within bounds
    status, _ = post(server, {"sae_id": sid, "prompt": PROMPT, "top_n": 2, "ablate_top": 0})
    assert status == 200 and calls == [1]


@pytest.mark.parametrize(
    "target",
    [
        "quick brown fox jumps",  # several tokens
        "",
        512,  # tiny-llama's vocabulary is 512 ids: 0 .. 511
        10**12,
        -1,
        True,
        1.5,
        [3],
        {"id": 3},
        "x" * 101,
    ],
)
def test_a_target_that_is_not_one_token_is_refused_naming_it(served, target):
    server, calls = served
    error = refused(
        post(server, {"sae_id": sae_id(), "prompt": PROMPT, "target_token": target}), 422, "VALIDATION_ERROR"
    )
    assert "target_token" in error["details"]["fields"], error
    assert calls == []


def test_an_unknown_sae_one_not_attached_and_no_model_are_refused_by_name(served):
    server, calls = served
    error = refused(post(server, {"sae_id": "sae_0000000000000000", "prompt": PROMPT}), 404, "SAE_NOT_FOUND")
    assert "sae_0000000000000000" in error["message"]
    other = sae_id("tiny-llama-L2-jumprelu")  # registered, not attached
    error = refused(post(server, {"sae_id": other, "prompt": PROMPT}), 409, "SAE_NOT_ATTACHED")
    assert error["details"]["layers"] == []
    error = refused(post(server, {"sae_id": sae_id(), "layer": 2, "prompt": PROMPT}), 409, "SAE_NOT_ATTACHED")
    assert error["details"]["layers"] == [LAYER] and error["details"]["param"] == "layer"
    refused(post(server, {"sae_id": "../../etc/passwd", "prompt": PROMPT}), 404, "SAE_NOT_FOUND")
    server.engine.unload_model()  # the next test's fixture loads it again
    refused(post(server, {"sae_id": sae_id(), "prompt": PROMPT}), 400, "MODEL_NOT_LOADED")
    assert calls == []


def test_on_vllm_attribution_is_a_400_naming_the_backend(vllm_llama):
    server, relu = vllm_llama
    error = refused(post(server, {"sae_id": relu.id, "prompt": PROMPT}), 400, "ATTRIBUTION_UNSUPPORTED")
    assert error["details"]["backend"] == "vllm" and error["details"]["capability"] == "gradients"
    assert "vllm" in error["message"]
