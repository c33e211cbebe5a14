"""``POST /v1/responses`` through the official ``openai`` client and raw HTTP: each answer
equals the chat completion of the same messages (the route is the chat path with another
shape), parses as the client's ``Response`` and validates against OpenAI's published
schemas; the stream's typed events add up to the unstreamed answer; what cannot be
honoured is refused naming its field before anything runs."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.v1.helpers import Raw, assert_openai_error, request
from tests.v1.openai_schema import assert_schema

MODEL = "tiny-llama"
PROMPT = "the sea and the sky"
SYSTEM = "Answer briefly."


def _post(server, body, headers=None) -> Raw:
    return request(server.base_url, "POST", "/responses", body, headers=headers)


def _chat_text(openai_client, messages, **kw) -> tuple[str, object]:
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content, out


def sse_events(resp: Raw) -> list[tuple[str, dict]]:
    """(``event:`` name, data) of each SSE event of a Responses stream."""
    out = []
    for block in resp.body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "error": "ResponseErrorEvent",
}


# --------------------------------------------------------------------------- parity


def test_a_greedy_response_is_the_chat_completion_of_its_messages(llama, openai_client):
    extra = {"ignore_eos": True}
    out = openai_client.responses.create(
        model=MODEL, instructions=SYSTEM, input=PROMPT, max_output_tokens=12, temperature=0, extra_body=extra
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    text, chat = _chat_text(openai_client, messages, max_completion_tokens=12, extra_body=extra)
    assert out.output_text == text and text
    # cut at max_output_tokens: incomplete, with its reason
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.id.startswith("resp_") and out.object == "response"
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens == 12
    assert out.usage.total_tokens == chat.usage.total_tokens
    assert out.instructions == SYSTEM and out.max_output_tokens == 12 and out.temperature == 0


def test_a_stopped_answer_is_completed_and_its_body_is_openais_response(llama, openai_client):
    messages = [{"role": "user", "content": PROMPT}]
    free, _ = _chat_text(openai_client, messages, max_tokens=10)
    stop = free[3:6]  # a piece of what the model says: the answer ends before it
    text, chat = _chat_text(openai_client, messages, max_tokens=10, stop=[stop])
    assert chat.choices[0].finish_reason == "stop"
    body = {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": 10,
        "temperature": 0,
        "stop": [stop],
        "metadata": {"run": "a"},
        "store": False,
        "service_tier": "flex",  # behind interactive work: the same answer
        "prompt_cache_key": "responses-test",
    }
    resp = _post(llama, body)
    assert resp.status == 200, resp.body[:300]
    out = resp.json()
    assert_schema("Response", out)
    assert out["status"] == "completed" and out["incomplete_details"] is None and out["error"] is None
    assert out["output"][0]["content"] == [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    assert out["metadata"] == {"run": "a"} and out["store"] is False and out["completed_at"] >= out["created_at"]
    assert out["service_tier"] == "flex"
    assert resp.headers["x-millm-backend"] and "x-millm-ignored-fields" not in resp.headers
    assert "millm" not in out  # no extension used


def test_input_items_are_the_chat_messages_they_name(llama, openai_client):
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
        {"role": "user", "content": "the sea"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "is grey"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "the sky"}],
        },
    ]
    out = openai_client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    messages = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": "the sea"},
        {"role": "assistant", "content": "is grey"},
        {"role": "user", "content": "and the sky"},
    ]
    text, _ = _chat_text(openai_client, messages, max_tokens=8)
    assert out.output_text == text
    # fed back, the answer's own output items are its assistant turn; chained by id, the same
    follow = openai_client.responses.create(
        model=MODEL,
        input=[*items, *[i.model_dump(exclude_none=True) for i in out.output], {"role": "user", "content": "why"}],
        max_output_tokens=8,
        temperature=0,
    )
    chained = openai_client.responses.create(
        model=MODEL,
        previous_response_id=out.id,
        input=[{"role": "user", "content": "why"}],
        max_output_tokens=8,
        temperature=0,
    )
    text, _ = _chat_text(
        openai_client,
        [*messages, {"role": "assistant", "content": out.output_text}, {"role": "user", "content": "why"}],
        max_tokens=8,
    )
    assert follow.output_text == chained.output_text == text
    # instructions are not carried over by previous_response_id (OpenAI's rule): the
    # chained request without them reads the first request's input items only
    first = openai_client.responses.create(
        model=MODEL, instructions=SYSTEM, input="the sea", max_output_tokens=4, temperature=0
    )
    again = openai_client.responses.create(
        model=MODEL, previous_response_id=first.id, input="and the sky", max_output_tokens=6, temperature=0
    )
    history = [
        {"role": "user", "content": "the sea"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and the sky"},
    ]
    without, _ = _chat_text(openai_client, history, max_tokens=6)
    with_system, _ = _chat_text(openai_client, [{"role": "system", "content": SYSTEM}, *history], max_tokens=6)
    assert again.output_text == without and again.instructions is None
    assert with_system != without  # a positive control: the instructions would change it


@pytest.fixture
def relu(llama):
    from tests.v1.conftest import attach

    return attach("tiny-llama-L1-relu", 1)


def test_steering_changes_the_answer_as_on_chat(relu, llama, openai_client):
    steering = {"features": [{"index": 3, "strength": 12.0}, {"index": 40, "strength": -6.5}]}
    common = {"max_output_tokens": 10, "temperature": 0}
    plain = openai_client.responses.create(model=MODEL, input=PROMPT, **common, extra_body={"ignore_eos": True})
    raw = openai_client.responses.with_raw_response.create(
        model=MODEL, input=PROMPT, **common, extra_body={"ignore_eos": True, "steering": steering}
    )
    steered = raw.parse()
    chat = openai_client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "steering": steering},
    )
    assert steered.output_text != plain.output_text  # the steer changes the answer
    assert steered.output_text == chat.parse().choices[0].message.content
    assert raw.headers["x-millm-steering"] == chat.headers["x-millm-steering"]
    millm = json.loads(raw.text)["millm"]
    assert millm["steering"] == json.loads(chat.text)["millm"]["steering"]
    assert millm["steering"]["mode"] == "inline"
    # streamed: the same text, and the millm object on the final Response
    stream = _post(
        llama, {"model": MODEL, "input": PROMPT, **common, "ignore_eos": True, "steering": steering, "stream": True}
    )
    events = [data for _, data in sse_events(stream)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == steered.output_text
    assert events[-1]["response"]["millm"]["steering"] == millm["steering"]
    assert stream.headers["x-millm-steering"] == chat.headers["x-millm-steering"]
    # another tool's shape (vLLM's vllm_xargs, a JSON string) is read as on chat
    xargs = {"steering": json.dumps(steering), "ngram_size": 30}
    aliased = _post(llama, {"model": MODEL, "input": PROMPT, **common, "ignore_eos": True, "vllm_xargs": xargs})
    assert aliased.json()["output"][0]["content"][0]["text"] == steered.output_text
    assert aliased.headers["x-millm-ignored-fields"] == '"vllm_xargs.ngram_size"'


def test_the_load_policy_and_the_errors_of_the_chat_path_apply(llama):
    refuse = {"X-miLLM-Load-Policy": "refuse"}
    body = {"model": "tiny-gpt2", "input": PROMPT, "max_output_tokens": 2}
    assert_openai_error(_post(llama, body, headers=refuse), 409, "model_not_resident", "model")
    assert_openai_error(_post(llama, {**body, "model": "no-such"}), 404, "model_not_found", "model")
    assert_openai_error(
        _post(llama, {**body, "model": MODEL, "profile": "no-such"}), 404, "profile_not_found", "profile"
    )
    assert llama.engine.status().model_id == "tiny-llama"


# --------------------------------------------------------------------------- text.format

SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "rough"]},
        "waves": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["mood", "waves"],
    "additionalProperties": False,
}


def test_a_json_schema_format_answers_json_valid_for_it(llama, openai_client):
    fmt = {"type": "json_schema", "name": "sea", "schema": SCHEMA, "strict": True}
    out = openai_client.responses.create(
        model=MODEL, input="Describe the sea.", max_output_tokens=120, temperature=0, text={"format": fmt}
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text.format.type == "json_schema" and out.text.format.name == "sea"
    # the same grammar as chat's response_format
    text, _ = _chat_text(
        openai_client,
        [{"role": "user", "content": "Describe the sea."}],
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True}},
    )
    assert out.output_text == text


# --------------------------------------------------------------------------- streaming


def test_the_stream_adds_up_to_the_answer_in_openais_event_order(llama, openai_client):
    common = {"model": MODEL, "input": PROMPT, "max_output_tokens": 9, "temperature": 0}
    whole = openai_client.responses.create(**common, extra_body={"ignore_eos": True})
    events = list(openai_client.responses.create(**common, stream=True, extra_body={"ignore_eos": True}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut at max_output_tokens
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    # the client's stream helper rebuilds a completed Response from the events (stopped
    # inside the text: the helper takes only response.completed as an end)
    stopped = {"ignore_eos": True, "stop": [whole.output_text[3:6]]}
    with openai_client.responses.stream(**common, extra_body=stopped) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        rebuilt = stream.get_final_response()
    assert rebuilt.status == "completed" and text == rebuilt.output_text
    assert whole.output_text.startswith(text) and len(text) < len(whole.output_text)
    # raw: each event's ``event:`` line names its type, each validates against OpenAI's schema
    raw = _post(llama, {**common, "stream": True, "ignore_eos": True})
    assert raw.status == 200 and raw.headers["content-type"].startswith("text/event-stream")
    for name, data in sse_events(raw):
        assert name == data["type"]
        assert_schema(EVENT_SCHEMAS[name], data)


# --------------------------------------------------------------------------- refusals

BASE = {"model": "tiny-gpt2", "input": PROMPT}  # not resident: nothing may load or run
BAD = [
    ({"input": [{"type": "image", "url": "x"}]}, "invalid_parameter", "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "field_not_honoured", "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "field_not_honoured",
        "input[0].content[0].type",
    ),
    ({"input": [42]}, "invalid_parameter", "input[0]"),
    ({"input": [{"type": "message", "content": "x"}]}, "invalid_parameter", "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "invalid_parameter",
        "input[0].content[0].text",
    ),
    ({"input": [{"type": "function_call_output", "output": "3"}]}, "invalid_parameter", "input[0].call_id"),
    ({"tool_choice": {"type": "function"}}, "invalid_parameter", "tool_choice.name"),
    ({"input": []}, "invalid_parameter", "input"),
    (
        {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        "invalid_parameter",
        "input[0].content[0].type",
    ),
    ({"tools": [{"type": "telepathy"}]}, "invalid_parameter", "tools[0]"),
    ({"tools": [{"type": "web_search"}]}, "field_not_honoured", "tools[0].type"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "field_not_honoured", "tool_choice"),
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
        "invalid_function_parameters",
        "tools[0].parameters",
    ),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_parameter", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "invalid_parameter", "metadata"),
    ({"max_output_tokens": 0}, "invalid_parameter", "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "field_not_honoured", "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "field_not_honoured", "include"),
    ({"truncation": "auto"}, "field_not_honoured", "truncation"),
    ({"service_tier": "priority"}, "field_not_honoured", "service_tier"),
    ({"prompt_cache_key": ""}, "invalid_parameter", "prompt_cache_key"),
    ({"prompt": {"id": "pmpt_1"}}, "field_not_honoured", "prompt"),
    ({"conversation": "conv_1"}, "field_not_honoured", "conversation"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "invalid_parameter", "text.format"),
    ({"text": {"format": {"type": "grammar"}}}, "field_not_honoured", "text.format.type"),
    ({"text": {"verbosity": "high"}}, "field_not_honoured", "text.verbosity"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "$ref": "http://x"}}}},
        "response_format_unsupported",
        "*",
    ),
    ({"previous_response_id": "resp_nope"}, "response_not_found", "previous_response_id"),
]


@pytest.mark.parametrize("extra,code,param", BAD, ids=[f"{p}:{c}" for _, c, p in BAD])
def test_bad_requests_are_refused_naming_their_field_before_anything_runs(llama, extra, code, param):
    resp = _post(llama, {**BASE, **extra})
    assert_openai_error(resp, 404 if code == "response_not_found" else 400, code, param)
    assert llama.engine.status().model_id == "tiny-llama"  # nothing loaded


def test_neutral_values_pass_and_unread_fields_are_named(llama):
    body = {
        "model": MODEL,
        "input": PROMPT,
        "max_output_tokens": 2,
        "reasoning": {"effort": "none"},
        "include": [],
        "truncation": "disabled",
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "user": "u1",
        "store": False,
    }
    resp = _post(llama, body)
    assert resp.status == 200, resp.body[:300]
    assert resp.headers["x-millm-ignored-fields"] == '"user"'
    strict = _post(llama, body, headers={"X-miLLM-Strict": "true"})
    assert_openai_error(strict, 400, "unused_fields_refused", "user")


async def _chunks(*blobs: bytes):
    for blob in blobs:
        yield blob


def test_an_error_after_the_first_event_is_an_error_event_then_response_failed():
    """The chat stream's error frame after a token (``openai_error_frame``, as
    ``stream_choices`` sends it) becomes OpenAI's ``error`` event and ``response.failed``,
    the failed Response stored with what was sent."""
    import asyncio

    from inference.errors import OpenAIError, openai_error_frame
    from inference.protocol_responses import ResponsesRequest
    from inference.responses_shape import response_skeleton
    from inference.responses_stream import response_events

    req = ResponsesRequest.model_validate({"model": MODEL, "input": PROMPT, "stream": True})
    # a token chunk carrying its own extension (its millm rides on the delta event)
    token = b'data: {"choices":[{"index":0,"delta":{"content":"the"}}],"millm":{"tick":1}}\n\n'
    error = OpenAIError("the engine stopped", status=500, code="generation_failed", type="server_error")
    saved: list[dict] = []

    async def save(body):
        saved.append(body)

    async def run():
        events = response_events(
            response_skeleton(req, "resp_x", 1), _chunks(token, openai_error_frame(error)), model=MODEL, save=save
        )
        return b"".join([blob async for blob in events])

    raw = Raw(200, {}, asyncio.run(run()))
    events = sse_events(raw)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "error",
        "response.failed",
    ]
    for name, data in events:
        assert_schema(EVENT_SCHEMAS[name], data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[-2][1]["code"] == "generation_failed"
    assert events[4][1]["millm"] == {"tick": 1}
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "the" and failed["output"][0]["status"] == "incomplete"
    assert saved == [failed]
