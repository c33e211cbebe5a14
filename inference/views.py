"""The /v1 endpoints: thin async views. Each parses and validates the body into its
pydantic model, applies the request policy to the fields it sent (``inference.policy``)
and hands over to ``inference.serving``; every error, whatever raised it, leaves through
``openai_view`` in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

import structlog
from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, JsonResponse
from pydantic import BaseModel

from core.auth import principal
from inference import selectors
from inference.embeddings import serve_embeddings
from inference.errors import (
    OpenAIError,
    openai_view,
    validate_body,
)
from inference.policy import (
    STRICT_HEADER,
    check_fields,
    strict_mode,
)
from inference.probe_scoring import probe_score as probe_score_run
from inference.probe_scoring import probe_score_parse
from inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)
from inference.quotas import admission_ticket
from inference.residency import ADMIN_ONLY, LOAD_POLICIES
from inference.serving import serve_generation
from inference.usage import charge_embeddings
from monitoring.ownership import Scope

log = structlog.get_logger(__name__)

LOAD_POLICY_HEADER = "X-miLLM-Load-Policy"
LEASE_HEADER = "X-miLLM-Lease"


def json_body(request: HttpRequest) -> dict[str, Any]:
    """The request's JSON object: 415 for another content type, 413 past the size limit,
    400 ``invalid_json`` for anything but a JSON object."""
    content_type = (request.content_type or "").lower()
    if content_type and content_type != "application/json" and not content_type.endswith("+json"):
        raise OpenAIError(
            f"Content-Type must be application/json (got {content_type})", status=415, code="unsupported_media_type"
        )
    try:
        raw = request.body
    except RequestDataTooBig:
        raise OpenAIError("The request body is too large", status=413, code="request_too_large") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise OpenAIError(
            f"The body is not valid JSON: {type(exc).__name__}", status=400, code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise OpenAIError("The body must be a JSON object", status=400, code="invalid_json")
    return data


def _body(request: HttpRequest, schema: type[BaseModel]) -> tuple[Any, list[str]]:
    """The validated body and the locations of the fields it sent that nothing reads
    (refused under ``X-miLLM-Strict``, as are fields that cannot be honoured)."""
    strict = strict_mode(request.headers.get(STRICT_HEADER))
    data = json_body(request)
    req = validate_body(schema, data)
    return req, check_fields(data=data, req=req, strict=strict)


def load_policy(request: HttpRequest) -> str:
    value = (request.headers.get(LOAD_POLICY_HEADER) or "auto").strip().lower()
    if value not in LOAD_POLICIES:
        raise OpenAIError(
            f"{LOAD_POLICY_HEADER} must be one of {', '.join(LOAD_POLICIES)}",
            status=400,
            code="invalid_parameter",
            param=LOAD_POLICY_HEADER,
        )
    if value == "auto" and not principal(request).admin:
        return ADMIN_ONLY  # an inference key never swaps the model everyone uses
    return value


async def _generation(request: HttpRequest, kind: str, schema: type[BaseModel]):
    req, ignored = _body(request, schema)
    max_tokens = getattr(req, "effective_max_tokens", None) if kind == "chat" else req.max_tokens
    async with admission_ticket(request, max_tokens=max_tokens, n=req.n):  # 429 over the key's quota
        return await serve_generation(
            kind=kind,
            req=req,
            policy=load_policy(request),
            lease=request.headers.get(LEASE_HEADER),
            ignored=ignored,
            scope=Scope.of_request(request),
        )


@openai_view("POST")
async def chat_completions(request: HttpRequest):
    return await _generation(request, "chat", ChatCompletionRequest)


@openai_view("POST")
async def completions(request: HttpRequest):
    return await _generation(request, "completion", CompletionRequest)


@openai_view("POST")
async def embeddings(request: HttpRequest):
    req, ignored = _body(request, EmbeddingRequest)
    async with admission_ticket(request):  # 429 over the key's quota
        body, headers = await serve_embeddings(
            req=req, ignored=ignored, policy=load_policy(request), lease=request.headers.get(LEASE_HEADER)
        )
        charge_embeddings(request, body)
    return JsonResponse(body, headers=headers)


def _card(row: Any, model_id: str | None = None) -> ModelCard:
    return ModelCard(id=model_id or row.name, created=int(row.created_at.timestamp()), owned_by=row.repo_id or "local")


def _json_object(request: HttpRequest) -> Any:
    try:
        return json.loads(request.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise OpenAIError(
            f"The body is not valid JSON: {type(exc).__name__}", status=400, code="invalid_json"
        ) from None


@openai_view("POST")
async def probe_score(request: HttpRequest):
    """/api/probes/score without the envelope, for OpenAI-style clients and Batch API
    lines (``inference.probe_scoring``)."""
    req = probe_score_parse(_json_object(request), model_required=True)
    body, headers = await probe_score_run(req, scope=Scope.of_request(request))
    return JsonResponse(body, headers=headers)


@openai_view("GET")
async def models(request: HttpRequest):
    listed = await sync_to_async(selectors.model_ids_listed)()
    return JsonResponse(ModelList(data=[_card(row, mid) for row, mid in listed]).model_dump())


@openai_view("GET")
async def model_detail(request: HttpRequest, model_id: str):
    row = await sync_to_async(selectors.model_listed)(name=model_id)
    return JsonResponse(_card(row, model_id).model_dump())


@openai_view("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
async def not_found(request: HttpRequest, rest: str = ""):
    raise OpenAIError(f"Unknown endpoint {request.method} {request.path}", status=404, code="unknown_url")
