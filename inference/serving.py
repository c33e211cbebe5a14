"""Serving one /v1 generation request: admission, residency, the engine jobs, and the
response — a JSON body or an SSE stream. What the request does (its model, steering,
monitoring and jobs: the ``Plan``) is decided before the first token, in
``inference.planning``.

Views stay thin (``inference.views``); everything that decides what a request does is
here, in ``inference.planning`` or in the resolvers it calls (``steering.services``,
``inference.activations``).
The engine is reached only through ``EngineClient`` (``agenerate`` for generation, other
calls on a worker thread), so the event loop never blocks.

Its parts: a choice run and finished (``inference.outcomes``), the JSON body
(``inference.shaping``), the SSE stream (``inference.streaming``); re-exported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.http import JsonResponse

from core.engine_client import EngineClient, arrived
from core.runtime import runtime
from gpu_engine.api import tracing
from gpu_engine.api.protocol import ErrorEvent
from inference.errors import OpenAIError, openai_error_event, openai_error_from_exception
from inference.fidelity import measure_fidelity
from inference.outcomes import (  # noqa: F401 - re-exported: a finished choice's steps
    Outcome,
    label_activations,
    outcome_of,
    probe_headers,
    probe_verdicts,
    prompt_only,
    record_monitoring,
    register_capture,
    run_analyses,
    run_choice,
    score_probes,
    sense,
)
from inference.planning import Plan, off_view_thread, plan_generation, resolve_model
from inference.protocol import ChatCompletionRequest, CompletionRequest
from inference.quotas import current_ticket
from inference.routing import routed
from inference.residency import resident_model_id
from inference.scoring import check_scoring, serve_scoring
from inference.shaping import (  # noqa: F401 - re-exported: the body's parts
    build_body,
    chat_finish_reason,
    chat_message,
    count_usage,
    millm_object,
    usage_of,
    wants_millm,
)
from inference.streaming import Resources, SSEResponse, Submitted, stream_choices
from inference.tools import refuse_tools_before_load
from monitoring.ownership import EVERYONE, Scope


async def answer_plan(
    plan: Plan, client: EngineClient, *, together: bool = True
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the plan's choices to their finish and answer them: the JSON body and its headers.
    The one execution of a non-streamed generation request, for the route and for a batch
    line (``batches.lines``). ``together``: every choice submitted at once (on a batching
    engine they share forward passes: n > 1, several prompts, extra_messages; on the serial
    one they queue in order); a batch line's run one after another, so a line holds the
    engine rows the runner counted for it."""
    if together:
        results = await asyncio.gather(*(run_choice(client, choice) for choice in plan.choices), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        outcomes: list[Outcome] = list(results)  # type: ignore[arg-type]
    else:
        outcomes = [await run_choice(client, choice) for choice in plan.choices]
    for outcome in outcomes:
        await measure_fidelity(plan, outcome, client)
        await record_monitoring(plan, outcome)
        await register_capture(plan, outcome)
        await score_probes(plan, outcome)
        sense(plan, outcome)
    if outcomes:
        await run_analyses(plan, outcomes[0])
        await label_activations(plan, outcomes[0])
    body = build_body(plan, outcomes)
    count_usage(plan, usage_of(plan, outcomes), outcomes=outcomes)
    return body, {**plan.headers, **probe_headers(plan, outcomes)}


async def open_stream(plan: Plan, client: EngineClient, res: Resources) -> AsyncIterator[bytes]:
    """The plan's SSE frames (``stream_choices``), once the engine's first event came: a
    refusal the engine makes at the start (context length, a detached SAE) is raised
    here, a proper HTTP error rather than a frame. Whoever sends the frames owns ``res``."""
    res.loop = asyncio.get_running_loop()
    res.events = client.agenerate(plan.choices[0].job)
    first = await anext(res.events)
    if isinstance(first, ErrorEvent):
        raise openai_error_event(first.code, first.message, first.details)
    res.later = [Submitted(client.agenerate(choice.job)) for choice in plan.choices[1:]]
    return stream_choices(plan, client, res, first)


async def respond(plan: Plan, client: EngineClient, res: Resources) -> Any:
    """Run the plan: a JSON response, or an SSE response that owns ``res`` from here."""
    if not plan.request.stream:
        body, headers = await answer_plan(plan, client)
        return JsonResponse(body, headers=headers)
    return SSEResponse(await open_stream(plan, client, res), on_close=res.release, headers=plan.headers)


def check_profile(req: ChatCompletionRequest | CompletionRequest, profile: str | None) -> None:
    """A model name that selects a profile (``model@profile``) and a body that names another
    are a contradiction, refused."""
    if profile is not None and req.profile is not None and profile != req.profile:
        raise OpenAIError(
            f"The model name selects profile {profile!r} but the body names {req.profile!r}",
            status=400,
            code="invalid_parameter",
            param="profile",
        )


# threads that wait for the engine's grammar builds (each at most the deadline; the engine
# runs two builds at once, more wait for a free one)
_GRAMMAR_WAITS = ThreadPoolExecutor(8, thread_name_prefix="millm-grammar-wait")


async def build_grammar(client: EngineClient, req: ChatCompletionRequest | CompletionRequest) -> None:
    """A ``response_format``'s grammar, built by the engine before the request takes an
    admission slot: a costly schema holds no one's slot while it builds, and one not built
    within STRUCTURED_COMPILE_TIMEOUT_S is 400 ``schema_too_complex`` here. (A tool call's
    grammar depends on the model's template: the engine builds it after admission, under
    the same deadline.)"""
    spec = req.structured() if req.allowed_token_ids is None else None
    if spec is None:
        return
    try:
        # its own threads: a build waits up to its deadline, and must not take the default
        # executor's, which the views' database work runs on (off_view_thread)
        await asyncio.get_running_loop().run_in_executor(_GRAMMAR_WAITS, client.build_grammar, spec)
    except Exception as exc:  # noqa: BLE001 - the engine's refusal, in /v1's shape
        raise openai_error_from_exception(exc) from None


async def serve_generation(
    *,
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    policy: str,
    lease: str | None = None,
    ignored: list[str] | None = None,
    scope: Scope = EVERYONE,
    answer: Callable[[Plan, EngineClient, Resources], Awaitable[Any]] = respond,
) -> Any:
    """Serve one generation request. ``answer`` runs the plan (``respond``: chat and
    completions; /v1/responses shapes its own answer, ``inference.responses_answer``); an
    ``SSEResponse`` it returns owns the request's resources from there. With several
    engines, on the engine of the model it names (``inference.residency.routed``)."""
    async with routed(req.model):
        return await _serve_generation(
            kind=kind, req=req, policy=policy, lease=lease, ignored=ignored, scope=scope, answer=answer
        )


async def _serve_generation(
    *,
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    policy: str,
    lease: str | None,
    ignored: list[str] | None,
    scope: Scope,
    answer: Callable[[Plan, EngineClient, Resources], Awaitable[Any]],
) -> Any:
    client = runtime().engine
    residency = runtime().residency
    status = await residency.status()
    model, profile = await resolve_model(req.model, status)
    check_profile(req, profile)
    if req.allowed_token_ids is not None:
        check_scoring(req)  # scoring mode: refused before anything loads or queues
    if getattr(req, "tools", None) and model.pk is not None and resident_model_id(status) != model.name:
        await off_view_thread(refuse_tools_before_load)(model.pk)
    # before queueing
    residency.check_policy(model, policy=policy, resident=resident_model_id(status), draining=status.draining)
    await build_grammar(client, req)
    permit = await runtime().admission.acquire()
    res = Resources(permit, quota=current_ticket())
    handed_over = False
    try:
        # a status read before a wait in the queue may be stale: read it again then
        res.use = await residency.acquire(model, policy=policy, status=None if permit.waited else status, lease=lease)
        if req.allowed_token_ids is not None:
            arrived()  # a score, not a generation: no batch waits for it
            return await serve_scoring(
                kind=kind, req=req, model_name=model.name, client=client, status=res.use.status, ignored=ignored
            )
        plan = await plan_generation(
            kind=kind,
            req=req,
            model=model,
            profile=req.profile or profile,
            client=client,
            attachments=list(res.use.status.attachments),
            status=res.use.status,
            ignored_fields=ignored,
            scope=scope,
        )
        plan.quota = res.quota
        with tracing.request_span(
            f"millm.v1.{kind}", {"millm.request_id": plan.object_id, "millm.steering_hash": plan.steering.hash}
        ) as span:
            if span is not None:  # OTEL_ENABLED: the engine's spans of the jobs are its children
                for choice in plan.choices:
                    choice.job.traceparent = tracing.traceparent()
            response = await answer(plan, client, res)
        handed_over = isinstance(response, SSEResponse)
        return response
    finally:
        if not handed_over:
            res.release()
