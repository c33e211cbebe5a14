"""``POST /v1/responses`` (OpenAI's Responses API): its request, and the chat request it
is translated into.

A Responses request is answered by the chat path: its ``input`` items (after the items of
the ``previous_response_id`` chain, ``inference.responses_store``) become chat messages,
``instructions`` a system message first, ``text.format`` the ``response_format``, its
flat function tools the chat ``tools``, ``max_output_tokens`` the
``max_completion_tokens``; the miLLM extensions (``steering``, ``profile``, ``capture``,
…) and the sampling extras pass through as they are. Steering, monitoring, capture,
probes, the field policy and the load policy then work as on ``/v1/chat/completions``,
because it is the same plan (``inference.planning``). The answer and the stream are shaped
in ``inference.responses_answer`` and ``inference.responses_stream``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import TypeAdapter, ValidationError

from inference.errors import OpenAIError, openai_error_from_validation, validate_body
from inference.policy import check_fields, template_kwargs
from inference.protocol import ChatCompletionRequest
from inference.protocol_responses import (
    OPENAI_ITEM_TYPES,
    OPENAI_PART_TYPES,
    PASSED,
    BuiltinTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    OtherContent,
    OtherItem,
    ResponsesRequest,
    TextContent,
    ToolChoiceFunction,
    ToolChoiceOther,
)
from inference.structured import SUPPORTED_TYPES
from inference.tools import check_tools


def check_items(items: list[Any], where: str = "input") -> None:
    """400 for an item or a content part this server cannot take: OpenAI's others
    (images, files, reasoning, hosted tools' calls, …) ``field_not_honoured``, a type
    OpenAI does not define ``invalid_parameter``; each naming where."""

    def refuse(kind: str, at: str, known: bool) -> OpenAIError:
        if known:
            return OpenAIError(
                f"{at} cannot be honoured: {kind} items and parts are not available (text messages, "
                "function_call and function_call_output are)",
                status=400,
                code="field_not_honoured",
                param=at,
            )
        return OpenAIError(f"{at}: unknown type {kind!r}", status=400, code="invalid_parameter", param=at)

    for i, item in enumerate(items):
        if isinstance(item, OtherItem):
            raise refuse(item.type, f"{where}[{i}].type", item.type in OPENAI_ITEM_TYPES)
        parts = item.content if isinstance(item, MessageItem) else getattr(item, "output", None)
        if isinstance(parts, list):
            field = "content" if isinstance(item, MessageItem) else "output"
            for j, part in enumerate(parts):
                if isinstance(part, OtherContent):
                    raise refuse(part.type, f"{where}[{i}].{field}[{j}].type", part.type in OPENAI_PART_TYPES)
        if isinstance(item, MessageItem) and isinstance(item.content, list):
            for j, part in enumerate(item.content):
                if isinstance(part, TextContent) and part.type == "output_text" and item.role != "assistant":
                    raise OpenAIError(
                        f"{where}[{i}].content[{j}]: output_text belongs to assistant messages",
                        status=400,
                        code="invalid_parameter",
                        param=f"{where}[{i}].content[{j}].type",
                    )


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses items as chat messages: consecutive ``function_call`` items become the
    ``tool_calls`` of one assistant message (the assistant's text before them included),
    each ``function_call_output`` a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


def parse_items(raw: list[dict[str, Any]], where: str) -> list[Any]:
    """Stored items (a ``previous_response_id`` chain) as the request's item models."""
    try:
        items = _ITEMS.validate_python(raw)
    except ValidationError as exc:
        raise OpenAIError(
            f"{where}: a stored item cannot be read back: {exc.errors()[0]['msg']}",
            status=400,
            code="invalid_parameter",
            param=where,
        ) from None
    check_items(items, where)
    return items


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice  # a string (ToolChoiceOther is refused by the policy before this)


def to_chat(req: ResponsesRequest, chain: list[Any] | None = None) -> ChatCompletionRequest:
    """The chat request that answers ``req``: ``instructions`` first, then the chain's
    items, then the request's own."""
    messages = chat_messages([*(chain or []), *req.input])
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        chat["stream_options"] = {"include_usage": True}  # the usage of response.completed
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls if req.tools else None),
    ):
        if value is not None:
            chat[name] = value
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = fmt.response_format()
    if req.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t.name),
                        ("description", t.description),
                        ("parameters", t.parameters),
                        ("strict", t.strict),
                    )
                    if v is not None
                },
            }
            for t in req.tools
            if isinstance(t, FunctionTool)
        ]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req)
    for name in PASSED:
        value = getattr(req, name)
        if value is not None:
            chat[name] = value
    try:
        out = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise rename(openai_error_from_validation(exc)) from None
    # another tool's steering shape was read on the Responses body: its errors name its fields
    return out if req.steering_alias is None else out.model_copy(update={"steering_alias": req.steering_alias})


# chat's parameter names → the Responses request's
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def rename(exc: OpenAIError) -> OpenAIError:
    """A chat-path error about a field, naming the Responses field it came from."""
    param = exc.param
    if not param:
        return exc
    new = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", param)
    for old, to in _RENAMES:
        if new == old or new.startswith(old + ".") or new.startswith(old + "["):
            new = to + new[len(old) :]
            break
    if new != param:
        exc.param = new
        exc.message = exc.message.replace(param, new)
    return exc


def check_chat(chat: ChatCompletionRequest) -> None:
    """The chat path's checks of what ``to_chat`` built (the schema subset, tools, the
    template's kwargs), before anything is loaded; errors name the Responses fields."""
    try:
        chat.structured()
        check_tools(chat)
        template_kwargs(chat)
    except OpenAIError as exc:
        raise rename(exc) from None


def _not_honoured(param: str, why: str) -> OpenAIError:
    return OpenAIError(f"{param} cannot be honoured: {why}", status=400, code="field_not_honoured", param=param)


def refuse_unhonoured_parts(req: ResponsesRequest) -> None:
    """The parts of ``tools``, ``tool_choice`` and ``text`` this server cannot honour,
    each refused naming where (the rest of ``inference.policy.UNHONOURED``'s work, inside
    fields whose other keys are read)."""
    for i, tool in enumerate(req.tools or ()):
        if isinstance(tool, BuiltinTool):
            raise _not_honoured(
                f"tools[{i}].type", f"the built-in tool {tool.type} is not available; send function tools"
            )
    if isinstance(req.tool_choice, ToolChoiceOther):
        raise _not_honoured(
            "tool_choice", 'the tool choices are "none", "auto", "required" and {"type": "function", "name"}'
        )
    text = req.text
    if text is not None and text.format is not None and text.format.type not in SUPPORTED_TYPES:
        raise _not_honoured("text.format.type", "the formats are text, json_object and json_schema")
    if text is not None and text.verbosity not in (None, "medium"):
        raise _not_honoured("text.verbosity", 'verbosity control is not available; "medium" (the model\'s own) is')


_STAND_IN = MessageItem(role="user", content="")


def parse_responses_request(data: dict[str, Any], *, strict: bool = False) -> tuple[ResponsesRequest, list[str]]:
    """The route's validation of a raw body: the request, and the locations of the fields
    nothing reads (``inference.policy``); raises OpenAIError. The background runner
    (``inference.responses_store``) validates a queued body again with it."""
    req = validate_body(ResponsesRequest, data)
    if not req.input and req.previous_response_id is None:
        raise OpenAIError(
            "input: nothing to answer: send input items (or previous_response_id to continue a response)",
            status=400,
            code="invalid_parameter",
            param="input",
        )
    refuse_unhonoured_parts(req)
    check_items(req.input)
    ignored = check_fields(data=data, req=req, strict=strict)
    # the translated request's own checks, before anything runs (a request that only
    # continues its chain is checked with a stand-in for the chain's turns)
    check_chat(to_chat(req, None if req.input else [_STAND_IN]))
    return req, ignored
