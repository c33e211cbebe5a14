"""OpenAI's published response schemas (tests/fixtures/openai_schemas.json, extracted by
scripts/openai_schemas.py from openai/openai-openapi): ``assert_schema(name, body)`` fails
with every violation when a /v1 answer breaks the schema a client is written against."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "openai_schemas.json"
BASE = "urn:openai-openapi"


def _nullable(node: Any) -> Any:
    """OpenAPI's ``nullable: true`` (left over from 3.0 in the published file) as JSON
    Schema: the schema, or null."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


# Where the published schema is stricter than OpenAI's own API: stream chunks carry
# ``finish_reason: null`` until the last one (as the official client types it), and with
# ``echo`` the first prompt token has no log-probability, sent as null (as the legacy API
# always did), though the file says string / number / object there.
_LOGPROBS = ("properties", "choices", "items", "properties", "logprobs", "anyOf", 0, "properties")
_SPEC_FIXES = [
    ("CreateChatCompletionStreamResponse", ("properties", "choices", "items", "properties", "finish_reason")),
    ("CreateCompletionResponse", ("properties", "choices", "items", "properties", "finish_reason")),
    ("CreateCompletionResponse", (*_LOGPROBS, "token_logprobs", "items")),
    ("CreateCompletionResponse", (*_LOGPROBS, "top_logprobs", "items")),
]


@cache
def _registry() -> Registry:
    schemas = _nullable(json.loads(FIXTURE.read_text())["schemas"])
    for name, path in _SPEC_FIXES:
        parent = schemas[name]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = {"anyOf": [parent[path[-1]], {"type": "null"}]}
    root = {"$id": BASE, "components": {"schemas": schemas}}
    return Registry().with_resource(BASE, Resource.from_contents(root, default_specification=DRAFT202012))


def violations(name: str, body: Any) -> list[str]:
    validator = Draft202012Validator({"$ref": f"{BASE}#/components/schemas/{name}"}, registry=_registry())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(body)]


def assert_schema(name: str, body: Any) -> None:
    found = violations(name, body)
    assert not found, f"{name}: " + "; ".join(found[:10])
