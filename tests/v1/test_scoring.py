"""Scoring mode on /v1 (``allowed_token_ids``): one unsteered forward pass, the next
token's distribution over the allowed ids, normalised over that set only. Checked against
the test's own forward of the same weights and its own normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.v1.conftest import attach
from tests.v1.helpers import assert_openai_error, request

PROMPT = "the sea and the sky"


def reference(server, ids: list[int], allowed: list[int], temperature: float | None = None) -> list[tuple[int, float]]:
    """``(id, logprob)`` over ``allowed``, most probable first, from a plain forward."""
    model = server.engine.backend.model
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    t = temperature or 1.0
    picked = [float(logits[i]) / t for i in allowed]
    lse = max(picked) + math.log(sum(math.exp(v - max(picked)) for v in picked))
    return sorted(((i, v - lse) for i, v in zip(allowed, picked)), key=lambda e: -e[1])


def _score(server, **extra):
    return request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1, **extra},
    )


def test_completions_scoring_is_normalised_over_the_allowed_ids(llama):
    backend = llama.engine.backend
    ids = backend.encode_text(PROMPT)
    allowed = [5, 17, 42, 300]
    for temperature in (None, 0.5):
        extra = {"allowed_token_ids": allowed, "logprobs": 4}
        if temperature is not None:
            extra["temperature"] = temperature
        resp = _score(llama, **extra)
        assert resp.status == 200, resp.body[:300]
        want = reference(llama, ids, allowed, temperature)
        (choice,) = resp.json()["choices"]
        assert choice["text"] == backend.token_text(want[0][0])
        lp = choice["logprobs"]
        assert lp["tokens"] == [backend.token_text(want[0][0])]
        assert lp["token_logprobs"][0] == pytest.approx(want[0][1], abs=1e-4)
        got = lp["top_logprobs"][0]
        assert got == pytest.approx({backend.token_text(i): v for i, v in want}, abs=1e-4)
        assert math.fsum(math.exp(v) for v in got.values()) == pytest.approx(1.0, abs=1e-6)
        assert lp["text_offset"] == [len(PROMPT)]
        assert resp.json()["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 1,
            "total_tokens": len(ids) + 1,
        }
    # keyed by id on request; without logprobs the choice carries none
    keyed = _score(llama, allowed_token_ids=allowed, logprobs=1, return_tokens_as_token_ids=True)
    assert set(keyed.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == {f"token_id:{i}" for i in allowed}
    bare = _score(llama, allowed_token_ids=allowed)
    assert bare.json()["choices"][0]["logprobs"] is None
    # several prompts: one choice each
    two = _score(llama, prompt=[[5, 6, 7], [9, 8]], allowed_token_ids=allowed, logprobs=1)
    assert [c["index"] for c in two.json()["choices"]] == [0, 1]
    for c, ids_i in zip(two.json()["choices"], ([5, 6, 7], [9, 8])):
        assert c["text"] == backend.token_text(reference(llama, ids_i, allowed)[0][0])
        assert c["logprobs"]["text_offset"] == [0]


def test_scoring_is_never_steered(llama):
    """Live steering that changes a generation leaves the scores exactly as they are."""
    sae = attach("tiny-llama-L1-relu", 1)
    allowed = [5, 17, 42, 300]
    before = _score(llama, allowed_token_ids=allowed, logprobs=4).json()
    plain = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    ).json()
    api = llama.base_url.rsplit("/v1", 1)[0] + "/api"
    assert request(api, "POST", "/saes/steering", {"sae_id": sae.id, "feature_idx": 3, "value": 150.0}).status == 200
    try:
        steered = request(
            llama.base_url,
            "POST",
            "/completions",
            {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        ).json()
        assert steered["choices"][0]["text"] != plain["choices"][0]["text"]  # positive control
        after = _score(llama, allowed_token_ids=allowed, logprobs=4)
        assert after.headers["x-millm-steering"] == "none"
        assert after.json()["choices"] == before["choices"]
    finally:
        request(api, "DELETE", f"/saes/steering?sae_id={sae.id}")


def test_chat_scoring_through_the_openai_client(llama, openai_client):
    messages = [{"role": "user", "content": "is the sea blue?"}]
    allowed = [5, 17, 42]
    resp = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"allowed_token_ids": allowed},
    )
    ids = llama.engine.backend.encode_messages(messages, add_generation_prompt=True)
    want = reference(llama, ids, allowed)
    backend = llama.engine.backend
    choice = resp.choices[0]
    assert choice.message.content == backend.token_text(want[0][0])
    (entry,) = choice.logprobs.content
    assert entry.logprob == pytest.approx(want[0][1], abs=1e-4)
    assert [(t.token, round(t.logprob, 4)) for t in entry.top_logprobs] == [
        (backend.token_text(i), round(v, 4)) for i, v in want
    ]
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 2}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stream": True}, "stream"),
        ({"stop": ["x"]}, "stop"),
        ({"seed": 3}, "seed"),
        ({"steering": {"features": [{"index": 1, "strength": 2}]}}, "steering"),
        ({"return_sae_activations": {"top_k": 2}}, "return_sae_activations"),
        ({"echo": True}, "echo"),
    ],
)
def test_what_scoring_cannot_honour_is_refused_before_anything_runs(llama, extra, param):
    body = {"allowed_token_ids": [5, 6], "max_tokens": 1, **extra}
    assert_openai_error(_score(llama, **body), 400, "invalid_parameter", param)


def test_bad_ids_and_unused_flag(llama):
    vocab = llama.engine.backend.vocab_size
    assert_openai_error(_score(llama, allowed_token_ids=[vocab]), 400, "invalid_parameter")
    assert_openai_error(_score(llama, allowed_token_ids=[1, 1]), 400, "invalid_parameter")
    plain = _score(llama, return_tokens_as_token_ids=True, temperature=0)
    assert plain.status == 200
    assert "return_tokens_as_token_ids" in plain.headers["x-millm-ignored-fields"]
