"""OpenAPI postprocessing (drf-spectacular hooks): the error envelope on every operation,
the bearer scheme and the /v1 paths."""

from __future__ import annotations

from typing import Any

_ERROR_ENVELOPE = {
    "type": "object",
    "required": ["success", "data", "error"],
    "properties": {
        "success": {"type": "boolean", "enum": [False]},
        "data": {"nullable": True},
        "error": {
            "type": "object",
            "required": ["code", "message", "details"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "details": {"type": "object", "additionalProperties": {}},
            },
        },
    },
}


def add_bearer_auth(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    components = result.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "Only when the server has MILLM_API_KEYS set.",
    }
    components.setdefault("schemas", {})["ErrorEnvelope"] = _ERROR_ENVELOPE
    open_paths = {"/api/health", "/api/health/ready"}
    for path, operations in result.get("paths", {}).items():
        for operation in operations.values():
            if not isinstance(operation, dict):
                continue
            operation["security"] = [] if path in open_paths else [{"bearerAuth": []}, {}]
            operation.setdefault("responses", {}).setdefault(
                "default",
                {
                    "description": "Error envelope (4xx/5xx); every 503 carries Retry-After",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
                },
            )
    return result


_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def add_v1_paths(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """The /v1 routes are plain async Django views with pydantic wire models, which
    drf-spectacular does not see; their operations are added from those models (JSON
    Schema 2020-12, hence OpenAPI 3.1)."""
    try:
        from inference import protocol
    except ImportError:  # the /v1 tier is not part of this build
        return result
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    template = "#/components/schemas/{model}"

    def ref(model: Any) -> dict[str, Any]:
        schema = model.model_json_schema(ref_template=template, mode="validation")
        for name, definition in schema.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        schemas[model.__name__] = schema
        return {"$ref": template.format(model=model.__name__)}

    schemas["OpenAIError"] = _OPENAI_ERROR
    error = {
        "description": "OpenAI-shaped error; every 503 carries Retry-After",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
    }

    def post(model: Any, summary: str, response: dict[str, Any]) -> dict[str, Any]:
        return {
            "post": {
                "operationId": f"v1_{model.__name__}",
                "summary": summary,
                "tags": ["v1"],
                "security": [{"bearerAuth": []}, {}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(model)}}},
                "responses": {"200": response, "default": error},
            }
        }

    stream = {
        "description": "JSON, or text/event-stream with stream=true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    paths = result.setdefault("paths", {})
    paths["/v1/chat/completions"] = post(
        protocol.ChatCompletionRequest, "Chat completion (steering and monitoring extensions)", stream
    )
    paths["/v1/completions"] = post(protocol.CompletionRequest, "Text completion", stream)
    paths["/v1/embeddings"] = post(
        protocol.EmbeddingRequest,
        "Embeddings (never steered)",
        {"description": "Embeddings", "content": {"application/json": {"schema": ref(protocol.EmbeddingResponse)}}},
    )
    paths["/v1/models"] = {
        "get": {
            "operationId": "v1_models",
            "summary": "Registered models",
            "tags": ["v1"],
            "security": [{"bearerAuth": []}, {}],
            "responses": {
                "200": {
                    "description": "Model list",
                    "content": {"application/json": {"schema": ref(protocol.ModelList)}},
                },
                "default": error,
            },
        }
    }
    paths["/v1/models/{model}"] = {
        "get": {
            "operationId": "v1_model",
            "summary": "One model",
            "tags": ["v1"],
            "security": [{"bearerAuth": []}, {}],
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "Model", "content": {"application/json": {"schema": ref(protocol.ModelCard)}}},
                "default": error,
            },
        }
    }
    _add_batch_and_probe_paths(paths, error)
    return result


def _add_batch_and_probe_paths(paths: dict[str, Any], error: dict[str, Any]) -> None:
    """/v1/files, /v1/batches (OpenAI's Batch API) and /v1/probes/score: plain views whose
    bodies are OpenAI's (files, batches) or miLLM's own (probes); their fields are in
    docs/api-v1.md, so the schema names each operation with an open object."""
    obj = {
        "description": "JSON object (docs/api-v1.md)",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }

    def op(
        name: str, summary: str, *, body: dict[str, Any] | None = None, params: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "operationId": f"v1_{name}",
            "summary": summary,
            "tags": ["v1"],
            "security": [{"bearerAuth": []}, {}],
            "responses": {"200": obj, "default": error},
            "parameters": [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params],
        }
        if body is not None:
            out["requestBody"] = {"required": True, "content": body}
        return out

    json_body = {"application/json": {"schema": {"type": "object"}}}
    upload = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": ["batch"]},
                },
            }
        }
    }
    paths["/v1/files"] = {
        "get": op("files_list", "Uploaded files"),
        "post": op("files_create", "Upload a JSONL batch input", body=upload),
    }
    paths["/v1/files/{file_id}"] = {
        "get": op("file", "One file", params=("file_id",)),
        "delete": op("file_delete", "Delete a file", params=("file_id",)),
    }
    paths["/v1/files/{file_id}/content"] = {
        "get": {
            **op("file_content", "A file's content (the JSONL as uploaded or written)", params=("file_id",)),
            "responses": {
                "200": {
                    "description": "JSONL",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                },
                "default": error,
            },
        }
    }
    paths["/v1/batches"] = {
        "get": op("batches_list", "Batches"),
        "post": op("batches_create", "Start a batch", body=json_body),
    }
    paths["/v1/batches/{batch_id}"] = {"get": op("batch", "One batch", params=("batch_id",))}
    paths["/v1/batches/{batch_id}/cancel"] = {"post": op("batch_cancel", "Cancel a batch", params=("batch_id",))}
    paths["/v1/probes/score"] = {
        "post": op("probes_score", "Score text with linear probes on SAE features", body=json_body)
    }
    # a stored response of the Responses API (docs/api-v1.md, "Responses API")
    paths["/v1/responses/{response_id}"] = {
        "get": op("response", "A stored response", params=("response_id",)),
        "delete": op("response_delete", "Delete a stored response", params=("response_id",)),
    }
    paths["/v1/responses/{response_id}/cancel"] = {
        "post": op("response_cancel", "Cancel a background response", params=("response_id",))
    }
    paths["/v1/responses/{response_id}/input_items"] = {
        "get": op("response_input_items", "A stored response's input items", params=("response_id",))
    }
