"""Every /v1 answer validates against OpenAI's published schema for it — the shapes the
official client, lm-eval and Open WebUI are written against — with miLLM's extensions
(``millm``) only where the schemas leave objects open."""

from __future__ import annotations

import copy

import pytest

from tests.v1.helpers import request
from tests.v1.openai_schema import assert_schema, violations

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "the sea"}]}
COMPLETION = {"model": "tiny-llama", "prompt": "the sea and", "max_tokens": 6, "temperature": 0}


def test_the_schemas_catch_a_broken_answer():
    """Positive control: a chat completion without its message's required fields fails."""
    good = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {"role": "assistant", "content": "hi", "refusal": None},
            }
        ],
    }
    assert violations("CreateChatCompletionResponse", good) == []
    broken = copy.deepcopy(good)
    del broken["choices"][0]["message"]["refusal"]
    assert any("refusal" in v for v in violations("CreateChatCompletionResponse", broken))


def test_chat_completion(llama):
    for body in (CHAT, {**CHAT, "logprobs": True, "top_logprobs": 2, "n": 2}):
        resp = request(llama.base_url, "POST", "/chat/completions", body)
        assert resp.status == 200, resp.body[:300]
        assert_schema("CreateChatCompletionResponse", resp.json())


def test_chat_stream_chunks(llama):
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1},
    )
    assert resp.status == 200
    events = resp.events()
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        assert_schema("CreateChatCompletionStreamResponse", chunk)


def test_completion(llama):
    for body in (COMPLETION, {**COMPLETION, "logprobs": 2, "echo": True}, {**COMPLETION, "prompt": ["a", "b"], "n": 2}):
        resp = request(llama.base_url, "POST", "/completions", body)
        assert resp.status == 200, resp.body[:300]
        assert_schema("CreateCompletionResponse", resp.json())
    stream = request(llama.base_url, "POST", "/completions", {**COMPLETION, "stream": True})
    for chunk in stream.events()[:-1]:
        # OpenAI streams completions as the completion object, chunk by chunk
        assert_schema("CreateCompletionResponse", chunk)


def test_embeddings_models_and_errors(llama):
    resp = request(llama.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": ["a", "b c"]})
    assert resp.status == 200, resp.body[:300]
    assert_schema("CreateEmbeddingResponse", resp.json())
    models = request(llama.base_url, "GET", "/models")
    assert_schema("ListModelsResponse", models.json())
    one = request(llama.base_url, "GET", "/models/tiny-llama")
    assert_schema("Model", one.json())
    error = request(llama.base_url, "POST", "/chat/completions", {**CHAT, "model": "nope"})
    assert error.status == 404
    assert_schema("ErrorResponse", error.json())
