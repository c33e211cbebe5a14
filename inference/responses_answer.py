"""``POST /v1/responses``: the route, and ``answer_response`` (its non-streamed run, also
the background runner's, ``inference.responses_runner``).

The request is validated and checked by the field policy (``inference.responses``), the
``previous_response_id`` chain is read (``inference.responses_store.load_chain``), and the
chat request it translates into is served by ``inference.serving.serve_generation`` — the
same admission, residency, plan, steering, monitoring, capture and probes as
``/v1/chat/completions`` — with the answer shaped as a Response
(``inference.responses_shape``) or streamed as its typed events
(``inference.responses_stream``). The Response is stored (``store``, OpenAI's default)
before it is sent."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, JsonResponse

from core.engine_client import EngineClient
from inference.errors import OpenAIError, openai_view
from inference.planning import Plan
from inference.policy import STRICT_HEADER, ignored_headers, strict_mode
from inference.protocol import ChatCompletionRequest
from inference.protocol_responses import ResponsesRequest
from inference.responses import parse_items, parse_responses_request, rename, to_chat
from inference.responses_shape import response_body, response_skeleton
from inference.responses_store import (
    input_items_of,
    load_chain,
    new_response_id,
    save_response,
    start_background,
)
from inference.quotas import admission_ticket
from inference.responses_stream import response_events
from inference.serving import answer_plan, open_stream, serve_generation
from inference.streaming import Resources, SSEResponse
from inference.views import LEASE_HEADER, json_body, load_policy
from monitoring.ownership import EVERYONE, Scope

__all__ = ["answer_response", "parse_responses_request", "responses_create"]


async def _chat(req: ResponsesRequest, scope: Scope) -> ChatCompletionRequest:
    """The chat request that answers ``req``, after the items of its chain."""
    chain = None
    if req.previous_response_id is not None:
        chain = parse_items(await load_chain(req.previous_response_id, scope), "previous_response_id")
    return to_chat(req, chain)


async def _serve(
    chat: ChatCompletionRequest, *, scope: Scope, policy: str, lease: str | None, ignored: list[str] | None, answer: Any
) -> Any:
    try:
        return await serve_generation(
            kind="chat", req=chat, policy=policy, lease=lease, ignored=ignored, scope=scope, answer=answer
        )
    except OpenAIError as exc:
        raise rename(exc) from None


def ran_as(plan: Plan, skeleton: dict[str, Any]) -> None:
    """What the plan settled, on the Response: the ``temperature`` and ``top_p`` it runs
    with (the request's, else the server's defaults: ``inference.planning.sampling_defaults``);
    and the plan's records (monitoring history, captures, probe verdicts, sensing) are
    kept under the Response's ``resp_…`` id."""
    plan.record_id = skeleton["id"]
    sampling = plan.choices[0].job.sampling
    skeleton.update(temperature=sampling.temperature, top_p=sampling.top_p)


async def answer_response(
    req: ResponsesRequest,
    *,
    scope: Scope = EVERYONE,
    policy: str,
    lease: str | None = None,
    ignored: list[str] | None = None,
    response_id: str | None = None,
    created_at: int | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run ``req`` unstreamed: the final Response and the response headers (those of the
    chat path: X-miLLM-Backend, X-miLLM-Steering, X-miLLM-Ignored-Fields, …). Stores
    nothing (the caller does)."""
    if req.stream:
        req = req.model_copy(update={"stream": False})
    skeleton = response_skeleton(req, response_id or new_response_id(), created_at or int(time.time()))

    async def answer(plan: Plan, client: EngineClient, res: Resources) -> tuple[dict[str, Any], dict[str, str]]:
        ran_as(plan, skeleton)
        chat, headers = await answer_plan(plan, client)
        return response_body(skeleton, chat), headers

    return await _serve(
        await _chat(req, scope), scope=scope, policy=policy, lease=lease, ignored=ignored, answer=answer
    )


@openai_view("POST")
async def responses_create(request: HttpRequest):
    strict = strict_mode(request.headers.get(STRICT_HEADER))
    data = json_body(request)
    req, ignored = parse_responses_request(data, strict=strict)
    async with admission_ticket(request, max_tokens=req.max_output_tokens):  # 429 over the key's quota
        return await _create(request, data, req, ignored)


async def _create(request: HttpRequest, data: dict[str, Any], req: ResponsesRequest, ignored: list[str]) -> Any:
    scope = Scope.of_request(request)
    policy, lease = load_policy(request), request.headers.get(LEASE_HEADER)
    items = input_items_of(data.get("input"))
    response_id, created_at = new_response_id(), int(time.time())
    if req.background:
        skeleton = response_skeleton(req, response_id, created_at)
        body = await start_background(data, skeleton, items, scope, policy=policy, lease=lease)
        return JsonResponse(body, headers=ignored_headers(ignored))
    if not req.stream:
        body, headers = await answer_response(
            req,
            scope=scope,
            policy=policy,
            lease=lease,
            ignored=ignored,
            response_id=response_id,
            created_at=created_at,
        )
        await save_response(body, items, scope, store=req.store)
        return JsonResponse(body, headers=headers)
    skeleton = response_skeleton(req, response_id, created_at)

    async def save(body: dict[str, Any]) -> None:
        await save_response(body, items, scope, store=req.store)

    async def answer(plan: Plan, client: EngineClient, res: Resources) -> SSEResponse:
        ran_as(plan, skeleton)
        chunks = await open_stream(plan, client, res)
        events = response_events(skeleton, chunks, model=plan.model.name, save=save, obfuscate=req.obfuscate)
        return SSEResponse(events, on_close=res.release, headers=plan.headers)

    return await _serve(
        await _chat(req, scope), scope=scope, policy=policy, lease=lease, ignored=ignored, answer=answer
    )
