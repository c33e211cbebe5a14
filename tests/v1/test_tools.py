"""``tools`` and ``tool_choice`` on /v1/chat/completions, through the official ``openai``
client and raw HTTP.

tiny-llama-tools is tiny-llama with ``<tool_call>``/``</tool_call>`` as single tokens and
a Hermes-style template that renders tools (``tests/v1/tools_model.py``); its weights are
random, so whatever it would say, only the grammar makes its calls valid — ``jsonschema``
checks them here. tiny-llama's own template ignores tools: there ``tools`` is refused.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from inference.protocol import ChatCompletionRequest
from inference.tools import ToolPlan, ToolStream, parse_tool_calls
from tests.v1.helpers import assert_openai_error, request
from tests.v1.openai_schema import assert_schema
from tests.v1.tools_model import NAME

OPEN_ID = 512  # <tool_call>, the first token added to tiny-llama's 512

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SCHEMAS = {
    "get_weather": WEATHER,
    "set_alarm": {
        "type": "object",
        "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            "repeat": {"type": "boolean"},
        },
        "required": ["hour", "minute", "repeat"],
    },
    "tag_items": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 1, "maxItems": 3},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
        },
        "required": ["tags", "note"],
    },
    "ping": None,  # no parameters: an empty object
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", **({"parameters": s} if s else {})}}
    for n, s in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _schema(name: str) -> dict:
    return SCHEMAS[name] or {"type": "object", "properties": {}, "additionalProperties": False}


def _check_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_the_capability_is_reported_where_the_template_renders_tools(tools_llm):
    caps = tools_llm.engine.status().batching["capabilities"]
    assert caps["tool_calling"] is True and caps["tool_call_format"] == "hermes"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_function_is_called_with_valid_arguments(tools_llm, openai_client, name):
    out = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], (name,))


def test_required_calls_one_of_the_tools_and_answers_openais_schema(tools_llm):
    body = {
        "model": NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 3,
        "n": 2,
    }
    resp = request(tools_llm.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    assert_schema("CreateChatCompletionResponse", resp.json())
    for choice in resp.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), _schema(call["function"]["name"]))


def test_auto_parses_a_call_when_one_is_made_and_text_otherwise(tools_llm, openai_client):
    # the model opens a call (forced by logit_bias); the grammar writes a valid one
    out = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=200,
        temperature=0,
        logit_bias={str(OPEN_ID): 100},
        parallel_tool_calls=False,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call)
    # it never opens one: text, no calls
    out = openai_client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0, logit_bias={str(OPEN_ID): -100}
    )
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    # none: tools rendered, nothing parsed, a forced opening stays text
    out = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=4,
        temperature=0,
        logit_bias={str(OPEN_ID): 100},
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content.startswith("<tool_call>")


def test_tool_calls_stream_as_whole_call_deltas(tools_llm, openai_client):
    stream = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0
    _check_call(deltas[0], ("get_weather",))
    # every chunk in OpenAI's schema, a forced auto call among text included
    resp = request(
        tools_llm.base_url,
        "POST",
        "/chat/completions",
        {
            "model": NAME,
            "messages": MESSAGES,
            "tools": TOOLS,
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "logit_bias": {str(OPEN_ID): 100},
            "parallel_tool_calls": False,
        },
    )
    events = resp.events()
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        assert_schema("CreateChatCompletionStreamResponse", chunk)
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
]


def test_a_multi_turn_conversation_renders_as_the_template_does(tools_llm, tools_model_dir):
    from transformers import AutoTokenizer

    from gpu_engine.api.protocol import GenerationJob
    from gpu_engine.runtime.prepare import prompt_ids

    # the template's own rendering, with transformers' conventions written out by hand
    tok = AutoTokenizer.from_pretrained(str(tools_model_dir))
    expected_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    text = tok.apply_chat_template(expected_messages, tools=[TOOLS[0]], tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Oslo", "unit": "c"}' in text and 'id="call_1"' in text
    expected = tok(text, add_special_tokens=False)["input_ids"]
    # what /v1 hands the engine for the same request, encoded by the loaded backend
    req = ChatCompletionRequest.model_validate({"model": NAME, "messages": CONVERSATION, "tools": [TOOLS[0]]})
    job = GenerationJob(request_id="t", messages=req.conversations()[0], tools=req.template_tools())
    assert prompt_ids(tools_llm.engine._backend, job) == expected
    # and the served request's prompt is that long
    resp = request(
        tools_llm.base_url,
        "POST",
        "/chat/completions",
        {"model": NAME, "messages": CONVERSATION, "tools": [TOOLS[0]], "max_tokens": 1, "tool_choice": "none"},
        headers={"X-miLLM-Strict": "1"},
    )
    assert resp.status == 200, resp.body[:300]
    assert resp.json()["usage"]["prompt_tokens"] == len(expected)


def test_refusals(llama):
    base = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2}
    # tiny-llama's template ignores tools: refused by name, nothing generated
    resp = request(llama.base_url, "POST", "/chat/completions", {**base, "tools": TOOLS})
    error = assert_openai_error(resp, 400, "field_not_honoured", "tools")
    assert "tiny-llama" in error["message"]
    named = {"type": "function", "function": {"name": "nope"}}
    resp = request(llama.base_url, "POST", "/chat/completions", {**base, "tools": TOOLS, "tool_choice": named})
    assert "nope" in assert_openai_error(resp, 400, "invalid_parameter", "tool_choice")["message"]
    for choice in ("required", named):
        resp = request(llama.base_url, "POST", "/chat/completions", {**base, "tool_choice": choice})
        assert_openai_error(resp, 400, "invalid_parameter", "tool_choice")
    bad = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}},
            },
        }
    ]
    resp = request(llama.base_url, "POST", "/chat/completions", {**base, "tools": bad})
    error = assert_openai_error(resp, 400, "invalid_function_parameters", "tools[0].function.parameters")
    assert "not" in error["message"]
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {**base, "tools": TOOLS, "response_format": {"type": "json_object"}},
    )
    assert_openai_error(resp, 400, "invalid_parameter", "response_format")
    resp = request(llama.base_url, "POST", "/chat/completions", {**base, "tools": TOOLS + TOOLS[:1]})
    assert_openai_error(resp, 400, "invalid_parameter", "tools[4]")


PLAN = ToolPlan("hermes", "auto", {"get_weather": WEATHER})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


def test_parsing_and_streaming_hold_back_only_what_may_open_a_call():
    content, calls = parse_tool_calls("Let me look. " + CALL + " done", PLAN)
    assert content == "Let me look.  done" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    # an unclosed or invalid call stays text
    assert parse_tool_calls(CALL[:-3], PLAN) == (CALL[:-3], [])
    assert parse_tool_calls(CALL.replace('"c"', '"k"'), PLAN)[1] == []
    stream = ToolStream(PLAN)
    pieces = ["Let me", " look. <to", "ol_c", "all>\n{", CALL[13:], " done"]
    sent = [stream.feed(p) for p in pieces]
    # whitespace waits for the text after it (here: after the call, in the rest)
    assert sent == ["Let me", " look.", "", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "  done" and len(calls) == 1
    assert "".join(sent) + rest == content
    # a "<" that opens no call is sent once it cannot
    stream = ToolStream(PLAN)
    assert [stream.feed(p) for p in ["a <", "b"]] == ["a", " <b"]
    assert stream.finish() == ("", [])


def test_tools_for_a_model_that_is_not_loaded_are_refused_before_loading_it(llama):
    """A registered model whose chat template never mentions tools is not loaded to find
    out: the request is refused first, and the resident model stays."""
    from registry.models import Model

    other = Model.objects.get(name="tiny-gpt2")
    before = llama.engine.status().model_id
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {"model": "tiny-gpt2", "messages": MESSAGES, "max_tokens": 2, "tools": TOOLS},
    )
    error = assert_openai_error(resp, 400, "field_not_honoured", "tools")
    assert "refused before loading" in error["message"]
    assert llama.engine.status().model_id == before == "tiny-llama"
    assert Model.objects.get(pk=other.pk).status == other.status
