"""``response_format`` and ``tools`` through /v1 with the official ``openai`` client, on a
GGUF served by the llama.cpp backend: tiny-llama-tools as a float32 GGUF (its template
renders tools; its random weights make only the grammar write valid JSON and calls).
Registered as a GGUF file (no backend named: GGUF means llamacpp); a tools request naming it
is not refused before the load (its template mentions tools), one naming a GGUF whose
template never does is."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.v1.conftest import model_resident
from tests.v1.helpers import assert_openai_error, request
from tests.v1.test_structured import FORMAT, SCHEMA

NAME = "tiny-llama-tools-gguf"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "minute": {"type": "integer", "minimum": 0, "maximum": 59},
    },
    "required": ["hour", "minute"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture
def gguf_tools_model(v1_server, tools_gguf, tiny_gguf):
    from inference.errors import OpenAIError
    from inference.tools import refuse_tools_before_load
    from registry.models import Model
    from registry.services import model_register_local

    row = Model.objects.filter(name=NAME).first() or model_register_local(local_path=str(tools_gguf), name=NAME)
    assert row.format == Model.Format.GGUF and row.effective_backend() == "llamacpp"
    refuse_tools_before_load(row.pk)  # the GGUF's template mentions tools: not refused
    plain = model_register_local(local_path=str(tiny_gguf), name="tiny-llama-gguf")
    with pytest.raises(OpenAIError) as caught:
        refuse_tools_before_load(plain.pk)
    assert caught.value.code == "field_not_honoured" and "never mentions tools" in caught.value.message
    model_resident(v1_server, NAME)
    v1_server.wait_idle()
    yield v1_server
    v1_server.wait_idle()


def test_tools_and_json_schema_on_llamacpp_through_the_openai_client(gguf_tools_model, openai_client):
    server = gguf_tools_model
    # named: one call of that function, arguments valid for it
    out = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    status = server.engine.status()
    assert (status.model_id, status.backend) == (NAME, "llamacpp")
    caps = status.batching["capabilities"]
    assert caps["tool_calling"] and caps["structured_output"]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # required, sampled, two choices: each one call of either tool
    out = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,
        temperature=1.0,
        seed=3,
        n=2,
        tool_choice="required",
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        schema = {"get_weather": WEATHER, "set_alarm": ALARM}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # response_format json_schema, streamed too
    out = openai_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=120, temperature=0, response_format=FORMAT
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    stream = openai_client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=120,
        temperature=0.7,
        seed=1,
        response_format=FORMAT,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # positive control: unconstrained, the random model's text is not JSON
    free = openai_client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)
    # a schema outside the subset is still refused by name, before anything runs
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}},
    }
    resp = request(
        server.base_url,
        "POST",
        "/chat/completions",
        {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "response_format": bad},
    )
    assert_openai_error(resp, 400, "response_format_unsupported", "response_format")
