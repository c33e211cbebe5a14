"""``tools`` and ``tool_choice`` on /v1/chat/completions: checked before anything runs,
constrained while the model writes, parsed into OpenAI's ``tool_calls`` afterwards.

Tools are honoured where the loaded model's chat template renders them: the engine
reports ``tool_calling`` and ``tool_call_format`` among its capabilities (a template that
renders the same text with and without a tool does not support them). Elsewhere
``tools`` is refused with ``400 field_not_honoured`` naming it.

A call is written as the template's family writes it (``tool_call_format``):

- ``hermes``: ``<tool_call>\\n{"name": "<f>", "arguments": {…}}\\n</tool_call>``, any number
  of them, with text around them under ``auto``;
- ``json``: one bare ``{"name": "<f>", "arguments": {…}}`` object (``parameters`` is
  read as ``arguments`` too).

``tool_choice``: ``required`` or a named function constrain the whole output to one call
whose arguments are valid for that function's ``parameters`` (xgrammar, as for
``response_format``); ``auto`` lets the model write text, and under ``hermes`` each call
it opens is constrained from its ``<tool_call>`` on (under ``json`` nothing marks a call's
start: a JSON object answer that names a tool and validates is a call, anything else is
text); ``none`` renders the tools and parses nothing. A call cut short by ``max_tokens``
is left in ``content`` as text (``finish_reason: "length"``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpu_engine.api.protocol import Capabilities, StructuredOutput
from inference.errors import OpenAIError
from inference.protocol import ChatCompletionRequest, NamedToolChoice
from inference.structured import check_schema
from registry.describe import chat_template_text
from registry.models import Model

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)
# OpenAI: a function without parameters takes none
_NO_PARAMETERS = {"type": "object", "properties": {}}


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def check_tools(req: ChatCompletionRequest) -> None:
    """Before anything runs: each function's ``parameters`` inside the schema subset the
    grammar enforces (``400 invalid_function_parameters`` naming where), names unique,
    ``tool_choice`` naming a function of ``tools``, and no combination we cannot honour."""
    mode = req.tool_choice_mode()
    tools = req.tools or []
    if mode in ("required", "named") and not tools:
        raise OpenAIError(
            f"tool_choice {_choice_text(req)} needs tools", status=400, code="invalid_parameter", param="tool_choice"
        )
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in names:
            raise OpenAIError(
                f"tools names the function {tool.function.name!r} twice",
                status=400,
                code="invalid_parameter",
                param=f"tools[{i}]",
            )
        names.add(tool.function.name)
        params = _parameters(tool)
        if params.get("type", "object") != "object":
            raise OpenAIError(
                f"tools[{i}].function.parameters must describe an object",
                status=400,
                code="invalid_function_parameters",
                param=f"tools[{i}].function.parameters",
            )
        try:
            check_schema(params, root=f"tools[{i}].function.parameters")
        except OpenAIError as exc:
            if exc.code == "schema_too_complex":  # names its field already
                raise
            message = exc.message.replace("response_format.json_schema.schema", f"tools[{i}].function.parameters", 1)
            raise OpenAIError(
                message, status=400, code="invalid_function_parameters", param=f"tools[{i}].function.parameters"
            ) from None
    if isinstance(req.tool_choice, NamedToolChoice) and req.tool_choice.function.name not in names:
        raise OpenAIError(
            f"tool_choice names the function {req.tool_choice.function.name!r}, "
            f"which tools does not define (defined: {', '.join(sorted(names))})",
            status=400,
            code="invalid_parameter",
            param="tool_choice",
        )
    if tools and mode != "none":
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise OpenAIError(
                "tools with tool_choice other than none cannot be combined with "
                "a JSON response_format (one grammar constrains an output)",
                status=400,
                code="invalid_parameter",
                param="response_format",
            )
    if tools and req.allowed_token_ids is not None:
        raise OpenAIError(
            "tools cannot be combined with allowed_token_ids (scoring mode generates nothing)",
            status=400,
            code="invalid_parameter",
            param="tools",
        )


def _choice_text(req: ChatCompletionRequest) -> str:
    choice = req.tool_choice
    return json.dumps(choice.model_dump() if isinstance(choice, NamedToolChoice) else choice)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do on the loaded model: the template family, the choice
    mode, the functions' parameter schemas, and the grammar the engine applies."""

    format: str  # hermes | json
    mode: str  # none | auto | required | named
    functions: dict[str, dict[str, Any]]
    structured: StructuredOutput | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def refuse_tools_before_load(model_pk: int) -> None:
    """Before a request with ``tools`` loads a model that is not resident: refuse at once
    (``400 field_not_honoured`` naming ``tools``) when it certainly cannot render them — a
    checkpoint or GGUF file whose chat template never mentions ``tools``. Otherwise the
    load goes ahead and the engine's own report decides (``tool_plan``); every backend
    constrains calls where the template renders tools."""
    from pathlib import Path

    row = Model.objects.filter(pk=model_pk).first()
    if row is None or not row.local_path:
        return
    text = chat_template_text(Path(row.local_path))
    if text is not None and "tools" not in text:
        raise OpenAIError(
            f"tools cannot be honoured on {row.name}: its chat template never "
            "mentions tools (refused before loading it)",
            status=400,
            code="field_not_honoured",
            param="tools",
        )


def tool_plan(req: ChatCompletionRequest, capabilities: Capabilities | None, model: str) -> ToolPlan | None:
    """The request's ``ToolPlan`` on a model whose capabilities are ``capabilities``, or
    None without tools; ``400 field_not_honoured`` naming ``tools`` where its chat template
    does not render them (or nothing reports capabilities)."""
    if not req.tools:
        return None
    if capabilities is None or not capabilities.tool_calling:
        raise OpenAIError(
            f"tools cannot be honoured: the chat template of {model} does not render tools",
            status=400,
            code="field_not_honoured",
            param="tools",
        )
    fmt = capabilities.tool_call_format or "json"
    mode = req.tool_choice_mode()
    functions = {t.function.name: _parameters(t) for t in req.tools}
    chosen = list(functions)
    if isinstance(req.tool_choice, NamedToolChoice):
        chosen = [req.tool_choice.function.name]
    structured = None
    if mode in ("required", "named") or (mode == "auto" and fmt == "hermes"):
        schema = json.dumps(
            [{"name": n, "parameters": functions[n]} for n in chosen], separators=(",", ":"), ensure_ascii=False
        )
        if mode != "auto":
            tool_mode = "required"
        else:
            tool_mode = "auto_single" if req.parallel_tool_calls is False else "auto"
        structured = StructuredOutput("tool_call", schema, tool_format=fmt, tool_mode=tool_mode)
    return ToolPlan(fmt, mode, functions, structured)


# --------------------------------------------------------------------------- parsing


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _valid(plan: ToolPlan, obj: Any) -> dict[str, Any] | None:
    """``obj`` as a call when it is ``{"name": <a tool>, "arguments": <valid>}``."""
    if not isinstance(obj, dict) or obj.get("name") not in plan.functions:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(args, dict):
        return None
    import jsonschema  # drf-spectacular's dependency; only unconstrained calls need it

    try:
        jsonschema.validate(args, plan.functions[obj["name"]])
    except jsonschema.ValidationError:
        return None
    return _call(obj["name"], args)


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str, list[dict[str, Any]]]:
    """The text outside the calls (unstripped) and the calls, in OpenAI's
    ChatCompletionMessageToolCall shape. A block that does not parse or validate stays
    in the text."""
    if not plan.parses:
        return text, []
    if plan.format == "json":
        try:
            call = _valid(plan, json.loads(text))
        except ValueError:
            call = None
        return ("", [call]) if call is not None else (text, [])
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _valid(plan, json.loads(match.group(1)))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[pos : match.start()])
        pos = match.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept), calls


@dataclass
class ToolStream:
    """One streamed choice's text under tools: content is sent as it comes until a call
    may be starting (a ``<tool_call>`` prefix, or a ``json`` answer opening with ``{``);
    from there it is held, and ``finish`` returns the rest of the content and the calls.
    Whitespace is sent only once text follows it, so that what is sent and the rest add
    up to the unstreamed answer's content (``tool_content``: without its trailing
    whitespace when there are calls)."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0
    holding: bool = False
    _calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if self.plan.format == "json":
            stripped = self.text.lstrip()
            if self.plan.mode != "auto" or not stripped or stripped.startswith("{"):
                self.holding = bool(stripped) or self.plan.mode != "auto"
                return ""
            return self._send(len(self.text))
        at = self.text.find(HERMES_OPEN, self.sent)
        if at != -1:
            self.holding = True
            return self._send(at)
        keep = 0  # the longest end of the text that could begin <tool_call>
        for k in range(min(len(HERMES_OPEN) - 1, len(self.text) - self.sent), 0, -1):
            if HERMES_OPEN.startswith(self.text[-k:]):
                keep = k
                break
        return self._send(len(self.text) - keep)

    def _send(self, end: int) -> str:
        if self.plan.format != "json":
            end = len(self.text[:end].rstrip())  # whitespace waits for what follows it
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parse_tool_calls(self.text, self.plan)
        # what was sent is a prefix of the content (nothing before the first call is cut)
        return (tool_content(content, calls) or "")[self.sent :], calls


def tool_content(content: str, calls: list[dict[str, Any]]) -> str | None:
    """A message's content under tools (``parse_tool_calls``'s text outside the calls):
    as written without calls; with calls, without its trailing whitespace, and none when
    only whitespace is left. What ``ToolStream`` sends adds up to it."""
    if not calls:
        return content
    return content.rstrip() or None


__all__ = ["ToolPlan", "ToolStream", "check_tools", "parse_tool_calls", "tool_content", "tool_plan"]
