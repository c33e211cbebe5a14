"""What structured output is tested with on every backend: the schemas (each output is
validated with ``jsonschema``, an independent validator, never with the grammar that
produced it), the tool functions, and how a test reads a Hermes tool call out of text."""

from __future__ import annotations

import json
import re

import jsonschema

from gpu_engine.api.protocol import GenerationJob, SamplingParams, StructuredOutput

# The grammar deadline (STRUCTURED_COMPILE_TIMEOUT_S) of the engines these schemas run on.
# A legitimate schema's first build (the child's xgrammar import included) passed the
# product's 10 s on a 2-core machine at load 7 and failed a test that is not about the
# deadline; tests/security/test_costly_inputs.py holds the deadline itself, at its own value.
COMPILE_TIMEOUT_S = 300.0

S = {"type": "string", "maxLength": 16}
SCHEMAS: list[tuple[str, dict]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": S, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    ),
    (
        "a colour",
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
    ),
    ("three tags", {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 3, "maxItems": 3}),
    ("a yes or no", {"type": "boolean"}),
    ("a percentage", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("a probability", {"type": "number", "minimum": 0, "maximum": 1}),
    ("a temperature in celsius", {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}),
    (
        "a postcode",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
    ),
    (
        "a city with a location",
        {
            "type": "object",
            "properties": {
                "city": S,
                "location": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "location"],
            "additionalProperties": False,
        },
    ),
    (
        "scores",
        {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 1, "maxItems": 4},
    ),
    ("a status", {"enum": ["ok", "warn", "error", None]}),
    ("a constant", {"const": {"version": 2}}),
    ("an id or a name", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, S]}),
    (
        "a task",
        {
            "type": "object",
            "properties": {"title": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}},
            "required": ["title", "done", "priority"],
            "additionalProperties": False,
        },
    ),
    ("a short word", {"type": "string", "minLength": 2, "maxLength": 6}),
    (
        "a pair",
        {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
            "items": False,
        },
    ),
    (
        "an optional note",
        {
            "type": "object",
            "properties": {"note": S, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["count"],
            "additionalProperties": False,
        },
    ),
    (
        "a node and its leaves",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        },
    ),
    ("a nullable count", {"type": ["integer", "null"], "minimum": 0, "maximum": 50}),
    (
        "a matrix",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
            },
        },
    ),
]


def structured_job(name: str, what: str, schema: dict | None, **sampling) -> GenerationJob:
    spec = (
        StructuredOutput("json_schema", json.dumps(schema)) if schema is not None else StructuredOutput("json_object")
    )
    params = {"max_tokens": 120, "temperature": 0.0, **sampling}
    return GenerationJob(
        name,
        messages=[{"role": "user", "content": f"Answer with JSON: {what}."}],
        sampling=SamplingParams(structured=spec, **params),
    )


# tool functions (their parameter schemas) for the tool-call grammar, and the calls'
# envelope as a Hermes template writes it
TOOL_PARAMETERS: dict[str, dict] = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "set_alarm": {
        "type": "object",
        "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            "repeat": {"type": "boolean"},
        },
        "required": ["hour", "minute", "repeat"],
    },
    "ping": {"type": "object", "properties": {}, "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": p}}
    for n, p in TOOL_PARAMETERS.items()
]
_HERMES_CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>", re.S)


def check_every_schema(engine, timeout_s: float) -> None:
    """Every schema of ``SCHEMAS`` at once (one batch), then the first four sampled: each
    output ends with the grammar (``stop``), parses and validates."""
    streams = [engine.generate(structured_job(f"s{i}", what, schema)) for i, (what, schema) in enumerate(SCHEMAS)]
    for (what, schema), stream in zip(SCHEMAS, streams):
        res = stream.result(timeout_s=timeout_s)
        assert res.finish_reason == "stop", (what, res.text)
        jsonschema.validate(json.loads(res.text), schema)
    for i, (what, schema) in enumerate(SCHEMAS[:4]):
        res = engine.generate_sync(structured_job(f"t{i}", what, schema, temperature=1.0, seed=i), timeout_s=timeout_s)
        assert res.finish_reason == "stop", (what, res.text)
        jsonschema.validate(json.loads(res.text), schema)


def tool_job(name: str, functions: list[str], **sampling) -> GenerationJob:
    """A chat job that must call one of ``functions`` (tool_choice required, or the named
    function when there is one) in the Hermes envelope."""
    spec = StructuredOutput(
        "tool_call",
        json.dumps([{"name": f, "parameters": TOOL_PARAMETERS[f]} for f in functions]),
        tool_format="hermes",
        tool_mode="required",
    )
    params = {"max_tokens": 160, "temperature": 0.0, **sampling}
    return GenerationJob(
        name,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS,
        sampling=SamplingParams(structured=spec, **params),
    )


def check_tool_call(text: str, functions: list[str]) -> dict:
    """The one call ``text`` is, its arguments valid for its function; fails otherwise."""
    match = _HERMES_CALL.fullmatch(text)
    assert match is not None, text
    call = json.loads(match.group(1))
    assert set(call) == {"name", "arguments"} and call["name"] in functions, call
    jsonschema.validate(call["arguments"], TOOL_PARAMETERS[call["name"]])
    return call
