"""``response_format`` on /v1, through the official ``openai`` client and raw HTTP.

tiny-llama's weights are random: whatever it would say, the grammar mask lets through
only JSON valid against the schema, which ``jsonschema`` checks here. Schemas outside the
supported subset are refused with 400 ``response_format_unsupported`` before any load.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.v1.helpers import assert_openai_error, request

SCHEMA = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "rough", "grey"]},
        "waves": {"type": "integer", "minimum": 0, "maximum": 9},
        "sunny": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["mood", "waves", "sunny", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe the sea."}]


def test_json_schema_through_the_openai_client_parses_and_validates(llama, openai_client):
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=120, temperature=0, response_format=FORMAT
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # sampled, n=2, each choice under its own matcher
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=5, n=2, response_format=FORMAT
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # positive control: unconstrained, the random model's text is not JSON
    free = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_json_schema_streams_and_on_completions(llama, openai_client):
    stream = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=120, temperature=0, response_format=FORMAT, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # completions: not in OpenAI's client signature, sent as an extra field (as vLLM takes it)
    out = openai_client.completions.create(
        model="tiny-llama",
        prompt="The sea:",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": FORMAT},
        extra_headers={"X-miLLM-Strict": "true"},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_json_object_answers_a_json_object(llama):
    body = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "max_tokens": 400,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "logit_bias": {},
    }
    resp = request(llama.base_url, "POST", "/chat/completions", body)
    assert resp.status == 200, resp.body[:300]
    choice = resp.json()["choices"][0]
    # the mask allows only a JSON object; a random model may still run out of tokens
    # inside it, which is OpenAI's "length" too
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


def _nest(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


UNSUPPORTED = [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "format": "credit-card"}, "credit-card"),
    ({"$ref": "https://example.com/schema.json"}, "references"),
    ({"type": "strin"}, "strin"),
    ({"type": "string", "pattern": "(?<=a)b"}, "lookaround"),
    (_nest(10), "nesting"),
    ({"enum": list(range(1001))}, "enum values"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)}}, "properties"),
]


@pytest.mark.parametrize("schema,named", UNSUPPORTED, ids=[n for _, n in UNSUPPORTED])
def test_schemas_outside_the_subset_are_refused_before_any_load(llama, schema, named):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for path, base in (("/chat/completions", {"messages": MESSAGES}), ("/completions", {"prompt": "the sea"})):
        body = {"model": "tiny-gpt2", "max_tokens": 4, "response_format": fmt, **base}
        error = assert_openai_error(
            request(llama.base_url, "POST", path, body), 400, "response_format_unsupported", "response_format"
        )
        assert named in error["message"]
    assert llama.engine.status().model_id == "tiny-llama"


def test_response_format_shapes(llama):
    bad_name = {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 4, "response_format": bad_name}
    assert_openai_error(request(llama.base_url, "POST", "/chat/completions", body), 400, "invalid_parameter")
    for other in ({"type": "grammar", "grammar": 'root ::= "x"'}, {"type": "regex"}):
        body["response_format"] = other
        assert_openai_error(
            request(llama.base_url, "POST", "/chat/completions", body), 400, "field_not_honoured", "response_format"
        )
