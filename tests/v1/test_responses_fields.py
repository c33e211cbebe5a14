"""``POST /v1/responses`` fields that follow the chat path's decisions: the stream's
obfuscation padding, the sampling parameters echoed as the plan ran them, the records
researchers look up by the Response's id, an ``input`` that only continues a chain, and a
streamed answer under ``tool_choice: auto`` that gives the unstreamed one's items."""

from __future__ import annotations

import json
import string
from types import SimpleNamespace

import pytest

from tests.v1.helpers import Raw, assert_openai_error, request
from tests.v1.openai_schema import assert_schema
from tests.v1.test_responses_background import responses_server, wait_status  # noqa: F401
from tests.v1.test_responses import EVENT_SCHEMAS, MODEL, PROMPT, SYSTEM, relu, sse_events  # noqa: F401
from tests.v1.test_responses_tools import CHAT_TOOL, TOOL
from tests.v1.tools_model import NAME as TOOLS_MODEL

DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


def _post(server, body, headers=None) -> Raw:
    return request(server.base_url, "POST", "/responses", body, headers=headers)


def _api(server, method, path, body=None):
    resp = request(server.url, method, "/api" + path, body)
    assert resp.status < 300, (method, path, resp.status, resp.body[:500])
    return resp.json()["data"]


def _data_lines(resp: Raw) -> list[tuple[str, str]]:
    """(``event:`` name, the ``data:`` line as sent) of each SSE event."""
    out = []
    for block in resp.body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if lines:
            out.append((lines["event"], lines["data"]))
    return out


# --------------------------------------------------------------------------- obfuscation


def test_include_obfuscation_pads_each_delta_event_to_whole_blocks(llama):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 8, "temperature": 0, "stream": True}
    plain = _post(llama, body)
    padded = _post(llama, {**body, "stream_options": {"include_obfuscation": True}})
    assert plain.status == padded.status == 200
    plain_lines, padded_lines = _data_lines(plain), _data_lines(padded)
    assert all("obfuscation" not in json.loads(data) for _, data in plain_lines)  # off unless asked, as chat
    deltas = 0
    for kind, data in padded_lines:
        event = json.loads(data)
        assert_schema(EVENT_SCHEMAS[kind], event)
        if kind not in DELTAS:
            assert "obfuscation" not in event, kind
            continue
        deltas += 1
        pad = event["obfuscation"]
        assert pad and set(pad) <= set(string.ascii_letters + string.digits)
        assert len(data.encode()) % 64 == 0, (len(data.encode()), data)  # whole 64-byte blocks
    assert deltas > 1
    # the same answer, event for event, but for the padding

    def text(lines):
        return "".join(json.loads(d)["delta"] for k, d in lines if k == "response.output_text.delta")

    assert text(padded_lines) == text(plain_lines) != ""
    assert [k for k, _ in padded_lines] == [k for k, _ in plain_lines]
    # unstreamed, stream_options is read by nothing, and named so; a bad value is a 400
    unstreamed = _post(llama, {**body, "stream": False, "stream_options": {"include_obfuscation": True}})
    assert unstreamed.status == 200 and unstreamed.headers["x-millm-ignored-fields"] == '"stream_options"'
    bad = _post(llama, {**body, "stream_options": {"include_obfuscation": "yes"}})
    assert_openai_error(bad, 400, "invalid_parameter", "stream_options.include_obfuscation")


# --------------------------------------------------------------------------- sampling echo


def test_temperature_and_top_p_are_echoed_as_the_answer_ran_them(llama, settings):
    status = llama.engine.status()
    batching = bool((status.batching or {}).get("enabled"))
    # what a request that sends none runs with: OpenAI's 1.0, or the batching engine's settings
    want = (float(settings.CBM_DEFAULT_TEMPERATURE), float(settings.CBM_DEFAULT_TOP_P)) if batching else (1.0, 1.0)
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 3}
    out = _post(llama, body)
    assert out.status == 200, out.body[:300]
    assert (out.json()["temperature"], out.json()["top_p"]) == want
    assert_schema("Response", out.json())
    events = sse_events(_post(llama, {**body, "stream": True}))
    for kind, data in events:
        if kind in ("response.created", "response.in_progress", "response.completed", "response.incomplete"):
            assert (data["response"]["temperature"], data["response"]["top_p"]) == want, kind
    sent = _post(llama, {**body, "temperature": 0.5, "top_p": 0.25}).json()
    assert (sent["temperature"], sent["top_p"]) == (0.5, 0.25)
    greedy = _post(llama, {**body, "temperature": 0}).json()
    assert greedy["temperature"] == 0


# --------------------------------------------------------------------------- records


def test_monitoring_records_are_found_by_the_response_id(relu, llama, openai_client):  # noqa: F811
    _api(
        llama,
        "POST",
        "/monitoring/configure",
        {"features": [3, 17, 40], "top_k": 4, "history_size": 500, "positions": "completion"},
    )
    common = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, **common
    )
    resp = openai_client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=5, **common)
    assert resp.output_text == chat.choices[0].message.content

    def history(request_id):
        records = _api(llama, "GET", f"/monitoring/history?request_id={request_id}&limit=500")["records"]
        return sorted((r["token_position"], r["layer"], r["activations"]) for r in records)

    def same(got, want):  # the same rows; the activations to float noise
        assert [(p, layer, [a["feature_index"] for a in acts]) for p, layer, acts in got] == [
            (p, layer, [a["feature_index"] for a in acts]) for p, layer, acts in want
        ]
        flat = [a["activation"] for *_, acts in got for a in acts]
        assert flat == pytest.approx([a["activation"] for *_, acts in want for a in acts], abs=1e-4)

    want = history(chat.id)
    assert len(want) == 5  # one record per completion token
    same(history(resp.id), want)  # the chat path's records, under the resp_ id
    # streamed: under the id its events carry
    events = sse_events(
        _post(
            llama,
            {
                "model": MODEL,
                "input": PROMPT,
                "max_output_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        )
    )
    streamed_id = events[0][1]["response"]["id"]
    assert streamed_id.startswith("resp_")
    same(history(streamed_id), want)


# --------------------------------------------------------------------------- input


def test_input_may_be_left_out_after_previous_response_id(llama, openai_client):
    first = openai_client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0)
    # only new instructions: the chain answered again under them
    again = _post(
        llama,
        {
            "model": MODEL,
            "previous_response_id": first.id,
            "instructions": SYSTEM,
            "max_output_tokens": 6,
            "temperature": 0,
        },
    )
    assert again.status == 200, again.body[:300]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first.output_text},
    ]
    chat = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert again.json()["output"][0]["content"][0]["text"] == chat.choices[0].message.content
    assert again.json()["instructions"] == SYSTEM
    # nothing to answer: a 400 naming input, and nothing stored
    for body in ({}, {"input": []}, {"input": None}, {"instructions": SYSTEM}):
        resp = _post(llama, {"model": MODEL, "max_output_tokens": 2, **body})
        assert_openai_error(resp, 400, "invalid_parameter", "input")


# --------------------------------------------------------------------------- tools


def _items(output):
    """The output items without their ids (minted per answer)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def test_a_stream_under_auto_gives_the_unstreamed_items(tools_llm, openai_client):
    # logit_bias makes newlines, one other byte and <tool_call> the likely tokens: the model
    # writes text (newlines first) before the call the grammar completes
    body = {
        "model": TOOLS_MODEL,
        "input": "What is the weather in Oslo?",
        "tools": [TOOL],
        "tool_choice": "auto",
        "max_output_tokens": 200,
        "temperature": 0,
        "parallel_tool_calls": False,
        "logit_bias": {"512": 100, "259": 100, "203": 100},
    }
    unstreamed = _post(tools_llm, body)
    assert unstreamed.status == 200, unstreamed.body[:300]
    output = unstreamed.json()["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]  # text, then the call
    text = output[0]["content"][0]["text"]
    assert text.strip() and text != text.strip()  # text the model wrote around whitespace
    # the same request through chat
    chat_request = {
        "model": TOOLS_MODEL,
        "messages": [{"role": "user", "content": body["input"]}],
        "tools": [CHAT_TOOL],
        "max_tokens": 200,
        "temperature": 0,
        "parallel_tool_calls": False,
        "logit_bias": body["logit_bias"],
    }
    chat = openai_client.chat.completions.create(**chat_request)
    assert text == chat.choices[0].message.content  # as chat answers it
    events = sse_events(_post(tools_llm, {**body, "stream": True}))
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    assert _items(final["output"]) == _items(output)
    assert "".join(d["delta"] for k, d in events if k == "response.output_text.delta") == text
    # and chat's own stream adds up to its body's content
    stream = openai_client.chat.completions.create(**chat_request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Sure.\n\n" + "<tool_call>\n{CALL}\n</tool_call>", 3),
        ("\n\n<tool_call>\n{CALL}\n</tool_call>\n", 2),
        ("  Look: <tool_call>\n{CALL}\n</tool_call>  then  \n", 5),
        ("no call at all  \n", 4),
    ],
)
def test_chat_stream_text_adds_up_to_the_body_content(text, pieces):
    """ToolStream (the stream) and the unstreamed message agree for any split of the text."""
    from inference.shaping import chat_message
    from inference.tools import ToolPlan, ToolStream

    weather = TOOL["parameters"]
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}})
    text = text.replace("{CALL}", call)
    plan = ToolPlan("hermes", "auto", {"get_weather": weather})
    body = chat_message(SimpleNamespace(tools=plan), text)  # the plan's one field it reads
    for size in range(1, len(text) // pieces + 2):
        stream = ToolStream(plan)
        sent = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = stream.finish()
        assert sent + rest == (body.content or ""), (size, sent, rest)
        assert len(calls) == len(body.tool_calls or [])


# --------------------------------------------------------------------------- background


def test_a_queued_response_has_no_null_usage_and_its_run_echoes_the_sampling_it_ran(
    responses_server,  # noqa: F811
    openai_client,
):
    queued = _post(responses_server, {"model": MODEL, "input": PROMPT, "max_output_tokens": 3, "background": True})
    assert queued.status == 200, queued.body[:300]
    body = queued.json()
    assert body["status"] == "queued" and "usage" not in body  # OpenAI's Response: an object or absent
    assert_schema("Response", body)
    done = wait_status(openai_client, body["id"])
    # the run echoes what it ran with, as the synchronous answer does
    sync = _post(responses_server, {"model": MODEL, "input": PROMPT, "max_output_tokens": 3}).json()
    assert sync["temperature"] is not None and sync["top_p"] is not None
    assert done.usage is not None and (done.temperature, done.top_p) == (sync["temperature"], sync["top_p"])
