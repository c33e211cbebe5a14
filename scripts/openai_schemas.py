#!/usr/bin/env python3
"""Extract the response schemas of the /v1 subset miLLM implements from OpenAI's published
OpenAPI description (shared/reference/openai-openapi.yaml, MIT) into
tests/fixtures/openai_schemas.json, with every schema they reference, so the test suite
validates responses against them without the 3 MB file.

    .venv/bin/python scripts/openai_schemas.py [path/to/openai-openapi.yaml]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOTS = [
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    # /v1/responses: the Response object and the stream events it sends
    "Response",
    "ResponseCreatedEvent",
    "ResponseInProgressEvent",
    "ResponseOutputItemAddedEvent",
    "ResponseContentPartAddedEvent",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseContentPartDoneEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseFunctionCallArgumentsDeltaEvent",
    "ResponseFunctionCallArgumentsDoneEvent",
    "ResponseCompletedEvent",
    "ResponseIncompleteEvent",
    "ResponseFailedEvent",
    "ResponseErrorEvent",
]
REPO = Path(__file__).resolve().parents[1]


def refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            refs(value, out)
    elif isinstance(node, list):
        for value in node:
            refs(value, out)


def main() -> None:
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO.parent / "shared" / "reference" / "openai-openapi.yaml"
    schemas = yaml.safe_load(source.read_text())["components"]["schemas"]
    keep: dict[str, object] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        found: set[str] = set()
        refs(schemas[name], found)
        todo += sorted(found - set(keep))
    out = REPO / "tests" / "fixtures" / "openai_schemas.json"
    out.write_text(
        json.dumps(
            {
                "source": "openai/openai-openapi commit f85dbe2 (MIT; tests/fixtures/"
                "openai-openapi.LICENSE), components.schemas",
                "schemas": dict(sorted(keep.items())),
            },
            indent=1,
            sort_keys=False,
        )
        + "\n"
    )
    print(f"{len(keep)} schemas -> {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
