"""Function tools on ``POST /v1/responses``: a call is a ``function_call`` output item with
the arguments chat's call has, its result goes back as a ``function_call_output`` item
(or after ``previous_response_id``) and is answered as chat answers the ``tool`` message,
and a streamed call is sent as its item and arguments events. tiny-llama-tools
(``tests/v1/tools_model.py``) has random weights: only the grammar makes its calls valid,
which ``jsonschema`` checks here."""

from __future__ import annotations

import json

import jsonschema

from tests.v1.helpers import request
from tests.v1.openai_schema import assert_schema
from tests.v1.test_responses import EVENT_SCHEMAS, sse_events
from tests.v1.tools_model import NAME

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER},
}
QUESTION = "What is the weather in Oslo?"
RESULT = '{"temperature": 3}'


def _chat(openai_client, messages, **kw):
    return openai_client.chat.completions.create(
        model=NAME, messages=messages, tools=[CHAT_TOOL], temperature=0, **kw
    ).choices[0]


def test_a_call_round_trip_is_answered_as_on_chat(tools_llm, openai_client):
    named = {"type": "function", "name": "get_weather"}
    out = openai_client.responses.create(
        model=NAME, input=QUESTION, tools=[TOOL], tool_choice=named, max_output_tokens=200, temperature=0
    )
    assert out.status == "completed"
    (item,) = out.output  # only the call: no message
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    chat = _chat(
        openai_client,
        [{"role": "user", "content": QUESTION}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
    )
    assert item.arguments == chat.message.tool_calls[0].function.arguments
    # the function's result, sent back with the call; and after previous_response_id
    answer = {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}
    common = {"model": NAME, "tools": [TOOL], "tool_choice": "none", "max_output_tokens": 8, "temperature": 0}
    explicit = openai_client.responses.create(
        input=[{"role": "user", "content": QUESTION}, item.model_dump(exclude_none=True), answer], **common
    )
    chained = openai_client.responses.create(previous_response_id=out.id, input=[answer], **common)
    call = {"id": item.call_id, "type": "function", "function": {"name": "get_weather", "arguments": item.arguments}}
    reference = _chat(
        openai_client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": item.call_id, "content": RESULT},
        ],
        tool_choice="none",
        max_tokens=8,
    )
    assert explicit.output_text == chained.output_text == reference.message.content
    assert explicit.output_text  # a positive control: there is text to compare


def test_a_streamed_call_is_its_item_and_arguments_events(tools_llm, openai_client):
    common = {
        "model": NAME,
        "input": QUESTION,
        "tools": [TOOL],
        "tool_choice": "required",
        "max_output_tokens": 200,
        "temperature": 0,
    }
    whole = openai_client.responses.create(**common)
    events = list(openai_client.responses.create(**common, stream=True))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[4]
    assert done.name == "get_weather" and done.arguments == events[3].delta == whole.output[0].arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)
    final = events[-1].response
    assert final.output[0].call_id == events[5].item.call_id and final.usage.output_tokens == whole.usage.output_tokens
    raw = request(tools_llm.base_url, "POST", "/responses", {**common, "stream": True})
    for name, data in sse_events(raw):
        assert_schema(EVENT_SCHEMAS[name], data)
