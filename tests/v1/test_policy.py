"""Request policy: every field a /v1 request sends is honoured or refused, never ignored
in silence. Unused fields are named in ``X-miLLM-Ignored-Fields`` (refused under
``X-miLLM-Strict``), output-changing fields the server cannot honour are refused with
``field_not_honoured`` before anything loads or runs, and ``logit_bias`` is honoured —
greedy and sampled, on chat and completions. Expectations are computed apart from the
wiring under test: the unbiased engine run and the model's own tokenizer."""

from __future__ import annotations

import re

import openai
import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams
from tests.v1.helpers import assert_openai_error, request

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
CHAT = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
STRICT = "X-miLLM-Strict"

_SF_STRING = re.compile(r'"((?:[^"\\]|\\["\\])*)"')


def sf_strings(value: str) -> list[str]:
    """An RFC 8941 list of strings, parsed (strictly: any other member fails)."""
    items: list[str] = []
    rest = value
    while rest:
        match = _SF_STRING.match(rest)
        assert match, f"not an sf-string at {rest!r}"
        items.append(re.sub(r"\\(.)", r"\1", match.group(1)))
        rest = rest[match.end() :]
        if rest:
            assert rest.startswith(", ") and len(rest) > 2, rest
            rest = rest[2:]
    return items


def ignored(resp) -> list[str] | None:
    value = resp.headers.get("x-millm-ignored-fields")
    return None if value is None else sf_strings(value)


# --------------------------------------------------------------------------- unused fields

UNUSED_CHAT = {
    **CHAT,
    "messages": [
        {"role": "system", "content": "be brief", "name": "rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me about the sea.", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ],
    "user": "u-1",
    "metadata": {"k": "v"},
    "safety_identifier": "s-1",
    "frobnicate": None,
    # read (neutral values ask for what the server does anyway)
    "store": False,
    "tools": [],
    "tool_choice": "none",
    "logit_bias": {},
    "n": 1,
    "logprobs": False,
    "response_format": {"type": "text"},
    "seed": 3,
}
# (a tool message's tool_call_id reaches the template: tiny-llama's ignores it)
UNUSED_CHAT_FIELDS = [
    "messages[0].name",
    "messages[1].content[0].cache_control",
    "user",
    "metadata",
    "safety_identifier",
    "frobnicate",
]


def test_ignored_fields_header_names_exactly_the_unused_fields(llama):
    body = {**UNUSED_CHAT, "stream_options": {"include_usage": True}}  # read only when streaming
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    assert ignored(resp) == [*UNUSED_CHAT_FIELDS, "stream_options"]
    # they really changed nothing: the same answer without them
    bare = {
        **CHAT,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Tell me about the sea."},
            {"role": "tool", "content": "42"},
        ],
        "seed": 3,
    }
    plain = request(llama.base_url, "POST", "/chat/completions", bare)
    assert plain.status == 200 and ignored(plain) is None
    assert resp.json()["choices"] == plain.json()["choices"]
    # max_completion_tokens wins over max_tokens, which is then unread
    both = request(llama.base_url, "POST", "/chat/completions", {**CHAT, "max_completion_tokens": 2})
    assert ignored(both) == ["max_tokens"]
    assert both.json()["usage"]["completion_tokens"] <= 2


def test_streamed_answers_carry_the_header(llama):
    body = {**UNUSED_CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200 and resp.events()[-1] == "[DONE]"
    assert ignored(resp) == UNUSED_CHAT_FIELDS  # include_obfuscation is read
    completion = request(
        llama.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": "the sea",
            "max_tokens": 2,
            "stream": True,
            "suffix": "",
            "echo": False,
            "x": {"y": 1},
        },
    )
    assert completion.status == 200 and ignored(completion) == ["x"]


def test_completions_and_embeddings_through_the_official_client(llama, openai_client):
    raw = openai_client.completions.with_raw_response.create(
        model="tiny-llama",
        prompt="the sea",
        max_tokens=2,
        user="u-7",
        best_of=1,
        extra_body={"frobnicate": {"deep": True}},
    )
    assert sorted(sf_strings(raw.headers["x-millm-ignored-fields"])) == ["frobnicate", "user"]
    assert raw.parse().choices[0].text is not None
    plain = openai_client.completions.with_raw_response.create(model="tiny-llama", prompt="the sea", max_tokens=2)
    assert "x-millm-ignored-fields" not in plain.headers
    emb = openai_client.embeddings.with_raw_response.create(
        model="tiny-llama", input="the sea", user="u-7", extra_body={"truncate": "END"}
    )
    assert sorted(sf_strings(emb.headers["x-millm-ignored-fields"])) == ["truncate", "user"]
    assert len(emb.parse().data) == 1


def test_the_header_is_capped_with_a_count_of_the_rest(llama):
    names = [f"unused_field_{i:03d}" for i in range(300)]
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, **dict.fromkeys(names, 1)},
    )
    assert resp.status == 200
    value = resp.headers["x-millm-ignored-fields"]
    assert len(value.encode()) <= 1024
    items = sf_strings(value)
    listed, more = items[:-1], items[-1]
    assert listed == names[: len(listed)] and len(listed) > 10
    assert more == f"+{300 - len(listed)} more"
    # the next name would not have fitted beside the count
    longer = ", ".join(f'"{n}"' for n in names[: len(listed) + 1])
    assert len(f'{longer}, "+{300 - len(listed) - 1} more"') > 1024
    # one name longer than the cap; a name outside printable ASCII is JSON-escaped
    resp = request(
        llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, "k" * 2000: 1}
    )
    assert ignored(resp) == ["+1 more"]
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, 'na\u00efve "q"': 1},
    )
    assert ignored(resp) == ['na\\u00efve "q"']


# --------------------------------------------------------------------------- strict mode


def test_strict_mode_refuses_unused_fields(llama, openai_client):
    resp = request(llama.base_url, "POST", "/chat/completions", UNUSED_CHAT, headers={STRICT: "true"})
    error = assert_openai_error(resp, 400, "unused_fields_refused", "messages[0].name")
    assert error["type"] == "invalid_request_error"
    for name in UNUSED_CHAT_FIELDS:
        assert f'"{name}"' in error["message"]
    assert ignored(resp) == UNUSED_CHAT_FIELDS
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=2, user="u-1", extra_headers={STRICT: "1"}
        )
    assert err.value.code == "unused_fields_refused" and err.value.param == "user"
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(model="tiny-llama", input="x", user="u-1", extra_headers={STRICT: "TRUE"})
    assert err.value.code == "unused_fields_refused"
    # strict and nothing unused: served; strict off: served with the header
    for value in ("True", "1"):
        ok = request(
            llama.base_url,
            "POST",
            "/chat/completions",
            {**CHAT, "tools": [], "logit_bias": {}},
            headers={STRICT: value},
        )
        assert ok.status == 200 and ignored(ok) is None
    for value in ("false", "0", "FALSE"):
        off = request(llama.base_url, "POST", "/chat/completions", UNUSED_CHAT, headers={STRICT: value})
        assert off.status == 200 and ignored(off) == UNUSED_CHAT_FIELDS


@pytest.mark.parametrize(
    "path,body",
    [
        ("/chat/completions", CHAT),
        ("/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}),
        ("/embeddings", {"model": "tiny-llama", "input": "x"}),
    ],
)
def test_a_strict_header_other_than_true_or_false_is_refused(llama, path, body):
    for value in ("yes", "2", "on", ""):
        resp = request(llama.base_url, "POST", path, body, headers={STRICT: value})
        error = assert_openai_error(resp, 400, "invalid_parameter", STRICT)
        assert error["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- refusals

NOT_HONOURED = [
    # (tools and tool_choice: honoured where the template renders tools, tests/v1/test_tools)
    ("/chat/completions", "functions", [{"name": "f"}]),
    ("/chat/completions", "function_call", {"name": "f"}),
    ("/chat/completions", "response_format", {"type": "grammar", "grammar": 'root ::= "x"'}),
    ("/completions", "response_format", {"type": "regex"}),
    ("/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/chat/completions", "modalities", ["text", "audio"]),
    ("/chat/completions", "prediction", {"type": "content", "content": "the sea"}),
    ("/chat/completions", "web_search_options", {}),
    ("/chat/completions", "moderation", {"model": "omni-moderation-latest"}),
    ("/chat/completions", "reasoning_effort", "low"),
    ("/chat/completions", "verbosity", "high"),
    ("/chat/completions", "store", True),
    ("/chat/completions", "service_tier", "priority"),
    ("/completions", "service_tier", "scale"),
    ("/completions", "suffix", " and the sky"),
    ("/completions", "best_of", 3),
    ("/embeddings", "dimensions", 8),
]
BASES = {
    "/chat/completions": {"messages": MESSAGES, "max_tokens": 2},
    "/completions": {"prompt": "the sea", "max_tokens": 2},
    "/embeddings": {"input": "the sea"},
}


@pytest.mark.parametrize("path,field,value", NOT_HONOURED, ids=[f"{p}:{f}" for p, f, _ in NOT_HONOURED])
def test_output_changing_fields_that_cannot_be_honoured_are_refused(llama, path, field, value):
    # named on a model that is not resident: refused before any load (or generation)
    body = {"model": "tiny-gpt2", **BASES[path], field: value}
    error = assert_openai_error(request(llama.base_url, "POST", path, body), 400, "field_not_honoured", field)
    assert field in error["message"]
    assert llama.engine.status().model_id == "tiny-llama"
    # strict mode does not change the code
    strict = request(llama.base_url, "POST", path, body, headers={STRICT: "true"})
    assert_openai_error(strict, 400, "field_not_honoured", field)


def test_neutral_values_change_nothing_and_pass(llama, openai_client):
    neutral = {
        "n": 1,
        "logprobs": False,
        "tools": [],
        "functions": [],
        "tool_choice": "none",
        "function_call": "auto",
        "logit_bias": {},
        "response_format": {"type": "text"},
        "audio": None,
        "modalities": ["text"],
        "prediction": None,
        "web_search_options": None,
        "moderation": None,
        "reasoning_effort": "none",
        "verbosity": "medium",
        "top_logprobs": 0,
        "store": False,
        "service_tier": "auto",
    }
    resp = request(llama.base_url, "POST", "/chat/completions", {**CHAT, **neutral}, headers={STRICT: "true"})
    assert resp.status == 200, resp.body[:300]
    assert ignored(resp) is None
    plain = request(llama.base_url, "POST", "/chat/completions", CHAT)
    assert resp.json()["choices"] == plain.json()["choices"]
    out = openai_client.completions.create(
        model="tiny-llama",
        prompt="the sea",
        max_tokens=2,
        n=2,
        best_of=2,
        suffix="",
        temperature=0,
        extra_headers={STRICT: "true"},
    )
    assert len(out.choices) == 2
    emb = request(
        llama.base_url,
        "POST",
        "/embeddings",
        {"model": "tiny-llama", "input": "x", "dimensions": None, "encoding_format": None},
        headers={STRICT: "true"},
    )
    assert emb.status == 200
    # null is "not given" for every optional field OpenAI declares
    nulls = dict.fromkeys(
        (
            "n",
            "stream",
            "logprobs",
            "top_logprobs",
            "stop",
            "seed",
            "stream_options",
            "logit_bias",
            "tools",
            "ignore_eos",
        )
    )
    resp = request(llama.base_url, "POST", "/chat/completions", {**CHAT, **nulls}, headers={STRICT: "true"})
    assert resp.status == 200, resp.body[:300]
    assert resp.json()["choices"] == plain.json()["choices"]
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": "x",
            "max_tokens": 1,
            "echo": None,
            "best_of": None,
            "suffix": None,
            "add_special_tokens": None,
        },
        headers={STRICT: "true"},
    )
    assert resp.status == 200, resp.body[:300]


# --------------------------------------------------------------------------- chat_template_kwargs

SERVER_SET_TEMPLATE_KWARGS = [
    ("add_generation_prompt", False),
    ("messages", []),
    ("conversation", []),
    ("tokenize", True),
    ("continue_final_message", True),
    ("tools", []),
    ("return_dict", False),
    ("bos_token", "x"),
]


@pytest.mark.parametrize("key,value", SERVER_SET_TEMPLATE_KWARGS, ids=[k for k, _ in SERVER_SET_TEMPLATE_KWARGS])
def test_template_kwargs_the_server_sets_are_refused_by_name(llama, key, value):
    # named on a model that is not resident: refused before any load
    body = {**CHAT, "model": "tiny-gpt2", "chat_template_kwargs": {key: value}}
    error = assert_openai_error(
        request(llama.base_url, "POST", "/chat/completions", body),
        400,
        "invalid_parameter",
        f"chat_template_kwargs.{key}",
    )
    assert f"chat_template_kwargs.{key}" in error["message"]
    assert "apply_chat_template" not in error["message"] and "jinja" not in error["message"]
    assert llama.engine.status().model_id == "tiny-llama"
    # in scoring mode too
    scoring = {**CHAT, "max_tokens": 1, "allowed_token_ids": [5, 6], "chat_template_kwargs": {key: value}}
    assert_openai_error(
        request(llama.base_url, "POST", "/chat/completions", scoring),
        400,
        "invalid_parameter",
        f"chat_template_kwargs.{key}",
    )


def test_a_template_variable_passes(llama):
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {**CHAT, "chat_template_kwargs": {"enable_thinking": False}},
        headers={STRICT: "true"},
    )
    assert resp.status == 200, resp.body[:300]


ONLY_CONTENT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_requests_own_chat_template_runs_only_when_the_operator_allows_it(llama, settings):
    body = {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}
    error = assert_openai_error(
        request(llama.base_url, "POST", "/chat/completions", body),
        400,
        "invalid_parameter",
        "chat_template_kwargs.chat_template",
    )
    assert "MILLM_ALLOW_REQUEST_CHAT_TEMPLATE" in error["message"]
    own = {**CHAT, "max_tokens": 4, "chat_template_kwargs": {"chat_template": ONLY_CONTENT}}
    assert request(llama.base_url, "POST", "/chat/completions", own).status == 400
    settings.MILLM_ALLOW_REQUEST_CHAT_TEMPLATE = True
    resp = request(llama.base_url, "POST", "/chat/completions", own)
    assert resp.status == 200, resp.body[:300]
    # the request's template rendered the prompt: just the message's text, no markers
    want = _unbiased(
        llama,
        prompt_token_ids=llama.engine.backend.encode_text(MESSAGES[0]["content"], add_special_tokens=False),
        sampling=SamplingParams(max_tokens=4, temperature=0),
    )
    assert resp.json()["choices"][0]["message"]["content"] == want.text
    assert resp.json()["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    plain = request(llama.base_url, "POST", "/chat/completions", CHAT).json()
    assert plain["usage"]["prompt_tokens"] != want.usage.prompt_tokens  # positive control
    # allowed, a template that fails is the client's 400, never a 500
    assert_openai_error(request(llama.base_url, "POST", "/chat/completions", body), 400, "invalid_parameter")


# --------------------------------------------------------------------------- logit_bias


def _unbiased(server, **job):
    return server.engine.generate_sync(GenerationJob(request_id="ref", **job), timeout_s=60)


@pytest.fixture
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets.models["tiny-llama"].path)


def test_a_strong_positive_bias_makes_greedy_output_that_token(llama, openai_client, tokenizer):
    ref = _unbiased(llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    target = tokenizer.encode(" lighthouse", add_special_tokens=False)[0]
    assert target not in ref.token_ids  # the bias has something to change
    expected = tokenizer.decode([target] * 6, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    out = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == expected
    assert ref.text != expected
    # completions, sampled and streamed too
    ids = tokenizer.encode("the sea", add_special_tokens=False)
    out = openai_client.completions.create(
        model="tiny-llama",
        prompt=ids,
        max_tokens=5,
        temperature=1.0,
        seed=4,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == tokenizer.decode(
        [target] * 5, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama",
            prompt=ids,
            max_tokens=5,
            temperature=0,
            stream=True,
            logit_bias={str(target): 100},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_a_minus_100_bias_bans_the_greedy_token(llama, openai_client):
    ref = _unbiased(
        llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=2)
    )
    greedy, runner_up = ref.logprobs[0].top_logprobs
    assert greedy.token_id == ref.token_ids[0] and greedy.token != runner_up.token
    out = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=1,
        temperature=0,
        logprobs=True,
        logit_bias={str(greedy.token_id): -100},
    )
    first = out.choices[0].logprobs.content[0]
    assert first.token == runner_up.token
    # log-probabilities are the model's own, before the bias (as vLLM reports them)
    assert first.logprob == pytest.approx(runner_up.logprob, abs=1e-5)


def test_logit_bias_outside_the_vocabulary_or_range_is_refused(llama):
    vocab = llama.engine.status().vocab_size
    for body, path in [
        ({**CHAT, "logit_bias": {str(vocab): 1}}, "/chat/completions"),
        ({**CHAT, "logit_bias": {str(vocab): 1}, "stream": True}, "/chat/completions"),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": 1, str(vocab + 7): -1}}, "/completions"),
        ({**CHAT, "logit_bias": {"5": -100.5}}, "/chat/completions"),
        ({**CHAT, "logit_bias": {"5": "high"}}, "/chat/completions"),
        ({**CHAT, "logit_bias": {"-5": 1}}, "/chat/completions"),
    ]:
        resp = request(llama.base_url, "POST", path, body)
        assert_openai_error(resp, 400, "invalid_parameter", "logit_bias")
    edge = request(
        llama.base_url, "POST", "/chat/completions", {**CHAT, "logit_bias": {str(vocab - 1): -100, "0": 100}}
    )
    assert edge.status == 200
