"""Answering one batch line as the synchronous route would, through the same engine.

The planning, the engine jobs and the response body are the synchronous route's own
(``inference.planning``, ``inference.serving``, ``inference.probe_scoring``), so a line's
body is what ``POST /v1/chat/completions`` (or ``/v1/completions``, ``/v1/embeddings``,
``/v1/probes/score``) would answer, and its headers are the X-miLLM-* values that route
would set. What differs:

- no admission slot: batch lines never take an interactive slot; the runner bounds how
  many are at the engine (BATCH_ENGINE_ROWS), and every job is marked
  ``priority="batch"``, so the engine admits interactive work first and gives batch lines
  only the rows kept for them (gpu_engine/scheduler.py);
- never a load: the residency policy is ``refuse``, so a batch cannot swap out a model —
  nor a leased one; it runs on the resident model or waits for it (``Unavailable``);
- no stream.

Probe-scoring lines (``/v1/probes/score``, the OpenAI-style twin of
``/api/probes/score``): every line is a /v1 call answered in OpenAI's shape, so a batch
calls the /v1 route rather than the /api one. Next-token scoring (``allowed_token_ids``)
is a chat or completions line like any other.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from core.metrics import record_tokens
from core.runtime import runtime
from gpu_engine.api.protocol import EmbedJob
from inference.errors import OpenAIError, openai_error_from_exception
from inference.planning import plan_generation, resolve_model
from inference.policy import check_dimensions, check_fields, ignored_headers
from inference.probe_scoring import probe_score, probe_score_parse
from inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageInfo,
)
from inference.residency import resident_model_id
from inference.serving import (
    ENGINE_CALL_TIMEOUT_S,
    build_body,
    count_usage,
    probe_headers,
    record_monitoring,
    register_capture,
    run_analyses,
    run_choice,
    score_probes,
    sense,
    usage_of,
)
from monitoring.ownership import EVERYONE, Scope

POLICY = "refuse"  # a batch never loads a model (docs/api-v1.md, "Batches")
# Refusals that say "not now" rather than "never": the line goes back in the queue and the
# batch waits (until its completion window ends) instead of failing it.
WAIT_CODES = frozenset({"model_not_resident", "model_not_loaded", "model_loading",
                        "model_busy", "queue_full", "engine_unavailable", "engine_busy",
                        "engine_shutdown", "insufficient_memory"})
DEFAULT_WAIT_S = 5


class Unavailable(Exception):
    """The engine cannot take the line now; retry after ``retry_after`` seconds."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = error.retry_after or DEFAULT_WAIT_S


@dataclass
class Answer:
    status_code: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


async def answer_line(endpoint: str, body: dict[str, Any],
                      scope: Scope = EVERYONE) -> Answer:
    """The line's answer (2xx or an OpenAI-shaped error), or ``Unavailable``; ``scope``:
    the batch owner's (its lines name the owner's probes, their captures are its)."""
    try:
        if endpoint == "/v1/embeddings":
            return await _embeddings(body)
        if endpoint == "/v1/probes/score":
            return await _probe_score(body, scope)
        kind, schema = (("chat", ChatCompletionRequest) if endpoint == "/v1/chat/completions"
                        else ("completion", CompletionRequest))
        return await _generation(kind, schema, body, scope)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is the line's answer
        error = openai_error_from_exception(exc)
        if error.status == 503 or error.code in WAIT_CODES:
            raise Unavailable(error) from None
        return Answer(error.status, error.body())


def _validate(schema: type, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """The line's request and the fields nothing reads, after the same field policy as the
    synchronous route (``inference.policy.check_fields``): a field that cannot be honoured
    is the line's 400, never dropped in silence."""
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        from inference.errors import openai_error_from_validation

        raise openai_error_from_validation(exc) from None
    return req, check_fields(data=body, req=req, strict=False)


async def _resident(name: str) -> tuple[Any, Any, str | None]:
    residency = runtime().residency
    status = await residency.status()
    model, profile = await resolve_model(name, status)
    residency.check_policy(model, policy=POLICY, resident=resident_model_id(status),
                           draining=status.draining)
    use = await residency.acquire(model, policy=POLICY, status=status)
    return model, use, profile


async def _generation(kind: str, schema: type, body: dict[str, Any],
                      scope: Scope = EVERYONE) -> Answer:
    req, ignored = _validate(schema, body)
    if req.stream:
        raise OpenAIError("stream is not available in a batch", status=400,
                          code="invalid_parameter", param="stream")
    model, use, profile = await _resident(req.model)
    try:
        if profile is not None and req.profile is not None and profile != req.profile:
            raise OpenAIError(f"The model name selects profile {profile!r} but the body "
                              f"names {req.profile!r}", status=400,
                              code="invalid_parameter", param="profile")
        client = runtime().engine
        plan = await plan_generation(kind=kind, req=req, model=model,
                                     profile=req.profile or profile, client=client,
                                     attachments=list(use.status.attachments),
                                     status=use.status, ignored_fields=ignored, scope=scope)
        for choice in plan.choices:
            choice.job.priority = "batch"
        outcomes = [await run_choice(client, choice) for choice in plan.choices]
        for outcome in outcomes:  # what inference.serving.respond does with a choice
            await record_monitoring(plan, outcome)
            await register_capture(plan, outcome)
            await score_probes(plan, outcome)
            sense(plan, outcome)
        if outcomes:
            await run_analyses(plan, outcomes[0])
        result = build_body(plan, outcomes)
        count_usage(plan, usage_of(plan, outcomes), outcomes=outcomes)
        return Answer(200, result, {**plan.headers, **probe_headers(plan, outcomes)})
    finally:
        use.release()


async def _probe_score(body: dict[str, Any], scope: Scope = EVERYONE) -> Answer:
    req = probe_score_parse(body, model_required=True)
    result, headers = await probe_score(req, priority="batch", admit=False, scope=scope)
    return Answer(200, result, headers)


async def _embeddings(body: dict[str, Any]) -> Answer:
    req, ignored = _validate(EmbeddingRequest, body)
    model, use, _ = await _resident(req.model)
    client = runtime().engine
    try:
        check_dimensions(req.dimensions, use.status.hidden_size)
        result = await asyncio.to_thread(
            client.embed, EmbedJob(request_id=f"embd-{uuid.uuid4().hex}",
                                   inputs=list(req.input), pooling="mean", normalize=True,
                                   priority="batch"),
            timeout_s=ENGINE_CALL_TIMEOUT_S)
    finally:
        use.release()
    record_tokens(model=model.name, completion_tokens=0,
                  prompt_tokens=result.usage.prompt_tokens)
    # the synchronous route's body (inference.views.embeddings, which no app may import)
    data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format))
            for i, v in enumerate(result.embeddings)]
    response = EmbeddingResponse(data=data, model=model.name, usage=UsageInfo(
        prompt_tokens=result.usage.prompt_tokens, total_tokens=result.usage.total_tokens))
    return Answer(200, response.model_dump(exclude={"usage": {"completion_tokens"}}),
                  {"X-miLLM-Backend": client.backend_name, "X-miLLM-Steering": "none",
                   **ignored_headers(ignored)})


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
