"""The Response object of ``POST /v1/responses`` (OpenAI's ``Response``), built from the
chat answer that computed it (``inference.responses``): the request's parameters echoed,
the ``output`` items (an assistant ``message`` with ``output_text``, then each
``function_call``), the ``usage`` in Responses' names, ``incomplete_details`` where
``max_output_tokens`` cut it, and the ``millm`` object of the extensions as on chat."""

from __future__ import annotations

import time
import uuid
from typing import Any

from inference.protocol import SERVICE_TIERS
from inference.protocol_responses import FunctionTool, ResponsesRequest, ToolChoiceFunction


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            # calls are always constrained to ``parameters``, as strict asks
            "strict": True if t.strict is None else t.strict,
        }
        for t in req.tools or []
        if isinstance(t, FunctionTool)
    ]


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "name": choice.name}
    return choice if isinstance(choice, str) else "auto"


def response_skeleton(req: ResponsesRequest, response_id: str, created_at: int) -> dict[str, Any]:
    """The Response before its output: ``in_progress``, the request's parameters echoed
    (a sampling parameter the request left out is null until the plan settles it:
    ``inference.responses_answer.ran_as``)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "completed_at": None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "background": req.background,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": req.text_format,
        "tools": _tools(req),
        "tool_choice": _tool_choice(req),
        "truncation": "disabled",
        "metadata": dict(req.metadata or {}),
        **({} if req.service_tier is None else {"service_tier": SERVICE_TIERS.get(req.service_tier)}),
        # usage: none until the end (OpenAI's schema has no null for it)
    }


def message_item(msg_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat ``tool_calls`` entry as a ``function_call`` output item (its ``call_id`` is
    the chat call's id: what ``function_call_output`` answers)."""
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage in Responses' names."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0), "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def finished(
    skeleton: dict[str, Any],
    *,
    model: str,
    output: list[dict[str, Any]],
    cut: bool,
    usage: dict[str, Any] | None,
    millm: dict[str, Any] | None,
) -> dict[str, Any]:
    """The final Response: ``completed``, or ``incomplete`` (reason ``max_output_tokens``)
    when the output was cut at the token limit."""
    body = {
        **skeleton,
        "model": model,
        "status": "incomplete" if cut else "completed",
        "completed_at": None if cut else int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
    }
    if usage is not None:
        body["usage"] = response_usage(usage)
    if millm is not None:
        body["millm"] = millm
    return body


def response_body(skeleton: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """The final Response of a non-streamed request, from its chat answer (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    cut = choice["finish_reason"] == "length"
    output: list[dict[str, Any]] = []
    if message.get("content") is not None:
        output.append(message_item(item_id("msg"), message["content"], "incomplete" if cut else "completed"))
    output += [call_item(call) for call in message.get("tool_calls") or []]
    return finished(skeleton, model=chat["model"], output=output, cut=cut, usage=chat["usage"], millm=chat.get("millm"))


def failed(skeleton: dict[str, Any], *, code: str, message: str, output: list[dict[str, Any]]) -> dict[str, Any]:
    """The Response of a stream that ended in an error: ``failed``, with what it sent."""
    return {**skeleton, "status": "failed", "error": {"code": code, "message": message}, "output": output}
