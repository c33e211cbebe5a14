"""The current Chat Completions request, field by field: every property of OpenAI's
``CreateChatCompletionRequest`` (and its allOf parents, as published in
tests/fixtures/openai_schemas.json) is read, refused by policy or named as ignored — a
property the spec adds later fails the conformance test until it is classified. The 2026
fields behave as documented (docs/api-v1.md, "Request policy"): ``prompt_cache_key`` (and
vLLM's ``cache_salt``) reaches every engine job of the request, ``service_tier`` "flex"
runs at batch priority and the answer names the tier, ``include_obfuscation`` pads each
delta chunk, and every value of the spec's enums is honoured or refused by name."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from inference.policy import UNHONOURED
from inference.protocol import ChatCompletionRequest, StreamOptions
from tests.v1.helpers import assert_openai_error, request
from tests.v1.test_policy import CHAT, MESSAGES, STRICT, ignored

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "openai_schemas.json"

# OpenAI's fields that change nothing here: nothing reads them, so a request that sends
# them gets them named in X-miLLM-Ignored-Fields (refused under X-miLLM-Strict)
IGNORED = {
    "user": "u-1",  # deprecated for safety_identifier and prompt_cache_key
    "safety_identifier": "s-1",
    "metadata": {"k": "v"},  # attached to stored completions, which are not kept (store)
    "prompt_cache_retention": "24h",  # the prefix caches evict by size, not by age
    "prompt_cache_options": {"ttl": "30m"},
}


def _schemas() -> dict:
    return json.loads(FIXTURE.read_text())["schemas"]


def _properties(name: str) -> dict:
    """A schema's properties, its allOf parents' included."""
    schema = _schemas()[name]
    out: dict = {}
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            out.update(_properties(part["$ref"].rsplit("/", 1)[1]))
        else:
            out.update(part.get("properties", {}))
    return out


def _enum(name: str) -> list[str]:
    schema = _schemas()[name]
    (values,) = [s["enum"] for s in schema.get("anyOf", [schema]) if "enum" in s]
    return values


def test_every_property_of_the_spec_is_read_refused_or_named_as_ignored():
    spec = _properties("CreateChatCompletionRequest")
    assert {"messages", "model", "prompt_cache_key", "safety_identifier", "service_tier"} <= set(spec)
    read = set(ChatCompletionRequest.model_fields)
    refused = {rule.name for rule in UNHONOURED[ChatCompletionRequest]}
    unclassified = sorted(set(spec) - read - refused - set(IGNORED))
    assert not unclassified, f"classify these fields of the spec: {unclassified}"
    # no field is both read and named ignored, and the ignored ones are the spec's
    assert not (read | refused) & set(IGNORED)
    assert set(IGNORED) <= set(spec)
    options = _properties("ChatCompletionStreamOptions") or {
        k: v for s in _schemas()["ChatCompletionStreamOptions"]["anyOf"] for k, v in s.get("properties", {}).items()
    }
    assert set(options) == {"include_usage", "include_obfuscation"} <= set(StreamOptions.model_fields)


def test_the_ignored_fields_are_named_and_refused_under_strict(llama):
    body = {**CHAT, **IGNORED}
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    assert ignored(resp) == list(IGNORED)
    strict = request(llama.base_url, "POST", "/chat/completions", body, headers={STRICT: "true"})
    assert_openai_error(strict, 400, "unused_fields_refused", "user")
    # the read ones pass strict mode
    read = {**CHAT, "prompt_cache_key": "k", "service_tier": "default", "store": False}
    ok = request(llama.base_url, "POST", "/chat/completions", read, headers={STRICT: "true"})
    assert ok.status == 200 and ignored(ok) is None


# --------------------------------------------------------------------------- enums

HONOURED_TIERS = {"auto": "default", "default": "default", "flex": "flex"}


@pytest.mark.parametrize("tier", _enum("ServiceTier"))
def test_each_service_tier_of_the_spec_is_honoured_and_named_or_refused(llama, tier):
    if tier not in HONOURED_TIERS:
        # named on a model that is not resident: refused before any load
        body = {**CHAT, "model": "tiny-gpt2", "service_tier": tier}
        error = assert_openai_error(
            request(llama.base_url, "POST", "/chat/completions", body), 400, "field_not_honoured", "service_tier"
        )
        assert "service_tier" in error["message"]
        assert llama.engine.status().model_id == "tiny-llama"
        return
    resp = request(llama.base_url, "POST", "/chat/completions", {**CHAT, "service_tier": tier})
    assert resp.status == 200, resp.body[:300]
    assert resp.json()["service_tier"] == HONOURED_TIERS[tier]
    plain = request(llama.base_url, "POST", "/chat/completions", CHAT).json()
    assert "service_tier" not in plain and resp.json()["choices"] == plain["choices"]
    streamed = request(
        llama.base_url, "POST", "/chat/completions", {**CHAT, "service_tier": tier, "stream": True}
    ).events()
    assert streamed[-1] == "[DONE]"
    assert {chunk["service_tier"] for chunk in streamed[:-1]} == {HONOURED_TIERS[tier]}


@pytest.mark.parametrize(
    "field,values,neutral",
    [
        ("reasoning_effort", _enum("ReasoningEffort"), "none"),
        ("verbosity", _enum("Verbosity"), "medium"),
    ],
)
def test_each_value_of_the_specs_effort_and_verbosity_is_neutral_or_refused(llama, field, values, neutral):
    assert neutral in values
    for value in values:
        body = {**CHAT, "model": "tiny-gpt2", field: value}
        if value == neutral:
            continue
        for headers in ({}, {STRICT: "true"}):
            resp = request(llama.base_url, "POST", "/chat/completions", body, headers=headers)
            assert_openai_error(resp, 400, "field_not_honoured", field)
    assert llama.engine.status().model_id == "tiny-llama"
    ok = request(llama.base_url, "POST", "/chat/completions", {**CHAT, field: neutral}, headers={STRICT: "true"})
    assert ok.status == 200 and ignored(ok) is None


# --------------------------------------------------------------------------- engine jobs


@pytest.fixture
def jobs(llama, monkeypatch):
    """The generation jobs the engine receives (its ``generate`` command's argument)."""
    seen: list = []
    engine = llama.engine
    real = engine.generate

    def spy(job, *args, **kwargs):
        seen.append(job)
        return real(job, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    return seen


def test_prompt_cache_key_and_flex_reach_every_engine_job(llama, jobs):
    extra = [[{"role": "user", "content": "And the sky?"}]]
    body = {**CHAT, "n": 2, "extra_messages": extra, "prompt_cache_key": "tenant-a", "service_tier": "flex"}
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    assert len(resp.json()["choices"]) == 4 and ignored(resp) is None
    (tenant_a,) = {j.cache_namespace for j in jobs}  # one namespace for every choice
    assert tenant_a is not None and [j.priority for j in jobs] == ["batch"] * 4
    jobs.clear()
    # vLLM's own name for it, streamed, and on completions
    resp = request(llama.base_url, "POST", "/chat/completions", {**CHAT, "cache_salt": "tenant-a", "stream": True})
    assert resp.status == 200 and resp.events()[-1] == "[DONE]"
    both = {"model": "tiny-llama", "prompt": ["a", "b"], "max_tokens": 1, "prompt_cache_key": "k", "cache_salt": "k"}
    assert request(llama.base_url, "POST", "/completions", both).status == 200
    salted, k1, k2 = (j.cache_namespace for j in jobs)
    assert salted == tenant_a and k1 == k2 not in (None, tenant_a)
    jobs.clear()
    # none sent: the shared namespace, at interactive priority
    assert request(llama.base_url, "POST", "/chat/completions", CHAT).status == 200
    assert [(j.cache_namespace, j.priority) for j in jobs] == [(None, "interactive")]


def _found(server, body: dict, headers: dict | None = None, admin: dict | None = None) -> bool:
    """Whether the engine's prefix cache found ``body``'s prompt stored (its own figures in
    /api/health/metrics): most of it reused — a short reuse is the chat template's opening,
    which every earlier request in the namespace shares."""

    def reused() -> int:
        resp = request(server.url, "GET", "/api/health/metrics", headers=admin)
        assert resp.status == 200, resp.body[:300]
        return resp.json()["data"]["prefix_cache"]["classes"]["unsteered"]["tokens_reused"]

    before = reused()
    resp = request(server.base_url, "POST", "/chat/completions", body, headers=headers)
    assert resp.status == 200, resp.body[:300]
    return reused() - before > resp.json()["usage"]["prompt_tokens"] // 2


def _fresh_chat() -> dict:
    # a prompt no earlier request stored
    prompt = f"{uuid.uuid4().hex} tell me about the sea, the sky and the hills " * 3
    return {**CHAT, "messages": [{"role": "user", "content": prompt}]}


def test_prompt_cache_key_is_the_prefix_caches_namespace(llama):
    """An identical prompt is found stored only under the key it was stored with (no key:
    the shared namespace)."""
    body = _fresh_chat()
    assert not _found(llama, {**body, "prompt_cache_key": "tenant-a"})
    assert _found(llama, {**body, "prompt_cache_key": "tenant-a"})  # positive control
    assert _found(llama, {**body, "cache_salt": "tenant-a"})  # vLLM's name for the same namespace
    assert not _found(llama, {**body, "prompt_cache_key": "tenant-b"})
    assert not _found(llama, body)  # the shared namespace holds none of theirs
    assert _found(llama, body)


def test_another_api_key_naming_the_same_prompt_cache_key_reaches_nothing(llama, settings):
    """A prompt_cache_key is the caller's: another key that names it neither reuses nor
    probes the entries stored under it (each key has its own namespace of that name)."""
    settings.MILLM_API_KEYS = ("bob:kb", "eve:ke")
    settings.MILLM_ADMIN_API_KEYS = ("root:kr",)
    bob, eve, root = ({"Authorization": f"Bearer {k}"} for k in ("kb", "ke", "kr"))
    body = {**_fresh_chat(), "prompt_cache_key": "team"}
    assert not _found(llama, body, bob, root)
    assert _found(llama, body, bob, root)  # positive control: bob's own entry
    assert not _found(llama, body, eve, root)  # eve's "team" is not bob's
    assert _found(llama, body, eve, root)
    assert _found(llama, body, bob, root)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"prompt_cache_key": "a", "cache_salt": "b"}, "cache_salt"),
        ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
        ({"prompt_cache_key": 7}, "prompt_cache_key"),
        ({"cache_salt": ["x"]}, "cache_salt"),
        ({"service_tier": 1}, "service_tier"),
        ({"stream": True, "stream_options": {"include_obfuscation": "yes"}}, "stream_options.include_obfuscation"),
    ],
)
def test_malformed_values_are_refused_by_name_before_anything_runs(llama, jobs, extra, param):
    body = {**CHAT, "model": "tiny-gpt2", **extra}
    assert_openai_error(request(llama.base_url, "POST", "/chat/completions", body), 400, "invalid_parameter", param)
    assert llama.engine.status().model_id == "tiny-llama" and jobs == []


def test_scoring_mode_names_the_cache_key_as_unread(llama, jobs):
    # one forward pass, scored without a generation job: nothing reads the key
    body = {**CHAT, "max_tokens": 1, "allowed_token_ids": [1, 2], "prompt_cache_key": "k"}
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    assert ignored(resp) == ["prompt_cache_key"] and jobs == []


# --------------------------------------------------------------------------- obfuscation


def _stream(llama, path: str, body: dict) -> list[str]:
    resp = request(llama.base_url, "POST", path, {**body, "stream": True})
    assert resp.status == 200, resp.body[:300]
    return resp.frames()


@pytest.mark.parametrize(
    "path,body",
    [
        ("/chat/completions", {**CHAT, "max_tokens": 8, "n": 2}),
        ("/completions", {"model": "tiny-llama", "prompt": "the sea", "max_tokens": 8, "temperature": 0}),
    ],
)
def test_include_obfuscation_pads_each_delta_chunk_to_a_block(llama, path, body):
    padded = _stream(llama, path, {**body, "stream_options": {"include_obfuscation": True, "include_usage": True}})
    plain = _stream(llama, path, {**body, "stream_options": {"include_obfuscation": False, "include_usage": True}})
    default = _stream(llama, path, {**body, "stream_options": {"include_usage": True}})
    assert padded[-1] == plain[-1] == "[DONE]"
    chunks = [json.loads(f) for f in padded[:-1]]
    deltas = [(frame, c) for frame, c in zip(padded, chunks) if c["choices"]]
    assert len(deltas) >= 4
    sizes = set()
    for frame, chunk in deltas:
        pad = chunk["obfuscation"]
        assert isinstance(pad, str) and pad.isalnum() and pad.isascii()
        # the frame as sent: a whole number of 64-byte blocks
        assert len(frame.encode()) % 64 == 0, (len(frame), frame)
        sizes.add(len(frame))
    # the usage chunk (no choices) is not padded
    assert "obfuscation" not in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] > 0
    # otherwise the same stream: without the padding, the chunks of the unpadded one
    for frames in (plain, default):
        other = [json.loads(f) for f in frames[:-1]]
        assert all("obfuscation" not in c for c in other)
        strip = [{k: v for k, v in c.items() if k not in ("obfuscation", "id", "created")} for c in chunks]
        assert strip == [{k: v for k, v in c.items() if k not in ("id", "created")} for c in other]
    # a request that does not stream leaves stream_options unread
    resp = request(llama.base_url, "POST", path, {**body, "stream_options": {"include_obfuscation": True}})
    assert ignored(resp) == ["stream_options"] and "obfuscation" not in resp.json()


def test_include_obfuscation_through_the_official_client(llama, openai_client):
    stream = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_obfuscation": True},
        extra_headers={STRICT: "true"},
    )
    chunks = list(stream)
    assert chunks and all(isinstance(c.to_dict().get("obfuscation"), str) for c in chunks)
