"""Answering one batch line as the synchronous route would, through the same engine.

The planning, the engine jobs and the response body are the synchronous route's own
(``inference.planning``, ``inference.serving``, ``inference.embeddings``,
``inference.probe_scoring``), so a line's body is what ``POST /v1/chat/completions`` (or
``/v1/completions``, ``/v1/embeddings``, ``/v1/probes/score``) would answer, and its
headers are the X-miLLM-* values that route would set. What differs:

- no admission slot: batch lines never take an interactive slot; the runner bounds how
  many are at the engine (BATCH_ENGINE_ROWS), and every job is marked
  ``priority="batch"``, so the engine admits interactive work first and gives batch lines
  only the rows kept for them (gpu_engine/runtime/scheduler.py);
- never a load: the residency policy is ``refuse``, so a batch cannot swap out a model —
  nor a leased one; it runs on the resident model or waits for it (``Unavailable``);
- no stream;
- quotas: a line counts against its batch owner's requests and tokens per minute
  (``KEY_LIMITS``, the windows its /v1 requests use), admitted when it is about to run
  (a chat or completions line once planned, so a bad line or a model still to come costs
  nothing) and charged what it used; over a limit it waits (back in the queue, the batch
  paused until the window frees), never fails. The concurrent limit does not apply.

Probe-scoring lines (``/v1/probes/score``, the OpenAI-style twin of
``/api/probes/score``): every line is a /v1 call answered in OpenAI's shape, so a batch
calls the /v1 route rather than the /api one. Next-token scoring (``allowed_token_ids``)
is a chat or completions line like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from core.runtime import runtime
from inference.embeddings import serve_embeddings
from inference.errors import OpenAIError, openai_error_from_exception, openai_error_from_validation
from inference.planning import plan_generation, resolve_model
from inference.policy import check_fields
from inference.probe_scoring import probe_score, probe_score_parse
from inference.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from inference.quotas import Refusal, Ticket, batch_line_ticket
from inference.routing import routed
from inference.residency import resident_model_id
from inference.serving import answer_plan, check_profile
from inference.usage import label_of
from monitoring.ownership import EVERYONE, Scope
from steering.live import LiveScopes

POLICY = "refuse"  # a batch never loads a model (docs/api-v1.md, "Batches")
# Refusals that say "not now" rather than "never": the line goes back in the queue and the
# batch waits (until its completion window ends) instead of failing it.
WAIT_CODES = frozenset(
    {
        "model_not_resident",
        "model_not_loaded",
        "model_loading",
        "model_busy",
        "queue_full",
        "engine_unavailable",
        "engine_busy",
        "engine_shutdown",
        "insufficient_memory",
        # the batch owner's key is over its requests or tokens per minute (KEY_LIMITS):
        # the line waits for its window rather than failing (inference.quotas.batch_line_ticket)
        "rate_limit_exceeded",
    }
)
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


@contextlib.asynccontextmanager
async def _quota(scope: Scope, body: dict[str, Any]) -> AsyncIterator[Ticket | None]:
    """The line's admission against its owner's key limits: a 429 ``rate_limit_exceeded``
    (a wait code: the line goes back in the queue) when over, else its ticket (None when
    nothing limits it), released when the line ends — charged the tokens its answer
    reports, the estimate given back when it reports none."""
    outcome = await batch_line_ticket(scope.owner, body)
    if isinstance(outcome, Refusal):
        raise OpenAIError(
            outcome.message(label_of(scope.owner)),
            status=429,
            code="rate_limit_exceeded",
            type="requests" if outcome.limit == "rpm" else "tokens",
            retry_after=outcome.retry_after_s,
        )
    try:
        yield outcome
    finally:
        if outcome is not None:
            outcome.release()


def _charge(ticket: Ticket | None, answer: Answer) -> Answer:
    usage = answer.body.get("usage") if isinstance(answer.body, dict) else None
    if ticket is not None and ticket.actual is None and isinstance(usage, dict):
        ticket.charge(int(usage.get("total_tokens") or 0))
    return answer


async def answer_line(
    endpoint: str, body: dict[str, Any], scope: Scope = EVERYONE, live_pinned: LiveScopes | None = None
) -> Answer:
    """The line's answer (2xx or an OpenAI-shaped error), or ``Unavailable``; ``scope``:
    the batch owner's (its lines name the owner's probes, their captures are its);
    ``live_pinned``: the batch's creation-time live steering (``Batch.live_steering``),
    None for the global one as of the line."""
    try:
        model = body.get("model")
        async with routed(model if isinstance(model, str) else None):  # the model's engine
            return await _answer_line(endpoint, body, scope, live_pinned)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is the line's answer
        error = openai_error_from_exception(exc)
        if error.status == 503 or error.code in WAIT_CODES:
            raise Unavailable(error) from None
        return Answer(error.status, error.body())


async def _answer_line(endpoint: str, body: dict[str, Any], scope: Scope, live_pinned: LiveScopes | None) -> Answer:
    if endpoint in ("/v1/embeddings", "/v1/probes/score"):
        async with _quota(scope, body) as ticket:
            if endpoint == "/v1/embeddings":
                return _charge(ticket, await _embeddings(body))
            return _charge(ticket, await _probe_score(body, scope))
    kind, schema = (
        ("chat", ChatCompletionRequest) if endpoint == "/v1/chat/completions" else ("completion", CompletionRequest)
    )
    return await _generation(kind, schema, body, scope, live_pinned)


def _validate(schema: type, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """The line's request and the fields nothing reads, after the same field policy as the
    synchronous route (``inference.policy.check_fields``): a field that cannot be honoured
    is the line's 400, never dropped in silence."""
    try:
        req = schema.model_validate(body)
    except ValidationError as exc:
        raise openai_error_from_validation(exc) from None
    return req, check_fields(data=body, req=req, strict=False)


async def _resident(name: str) -> tuple[Any, Any, str | None]:
    residency = runtime().residency
    status = await residency.status()
    model, profile = await resolve_model(name, status)
    residency.check_policy(model, policy=POLICY, resident=resident_model_id(status), draining=status.draining)
    use = await residency.acquire(model, policy=POLICY, status=status)
    return model, use, profile


async def _generation(
    kind: str, schema: type, body: dict[str, Any], scope: Scope = EVERYONE, live_pinned: LiveScopes | None = None
) -> Answer:
    req, ignored = _validate(schema, body)
    if req.stream:
        raise OpenAIError("stream is not available in a batch", status=400, code="invalid_parameter", param="stream")
    model, use, profile = await _resident(req.model)
    try:
        check_profile(req, profile)
        client = runtime().engine
        plan = await plan_generation(
            kind=kind,
            req=req,
            model=model,
            profile=req.profile or profile,
            client=client,
            attachments=list(use.status.attachments),
            status=use.status,
            ignored_fields=ignored,
            scope=scope,
            live_pinned=live_pinned,
        )
        for choice in plan.choices:
            choice.job.priority = "batch"
        async with _quota(scope, body) as ticket:
            plan.quota = ticket  # charged the line's real tokens (inference.usage.request_ended)
            # the route's own execution and body (inference.serving), its choices one by one
            answered, headers = await answer_plan(plan, client, together=False)
        return Answer(200, answered, headers)
    finally:
        use.release()


async def _probe_score(body: dict[str, Any], scope: Scope = EVERYONE) -> Answer:
    req = probe_score_parse(body, model_required=True)
    result, headers = await probe_score(req, priority="batch", admit=False, scope=scope)
    return Answer(200, result, headers)


async def _embeddings(body: dict[str, Any]) -> Answer:
    req, ignored = _validate(EmbeddingRequest, body)
    # the route's own execution and body (inference.embeddings), without a slot
    result, headers = await serve_embeddings(req=req, ignored=ignored, policy=POLICY, priority="batch", admit=False)
    return Answer(200, result, headers)
