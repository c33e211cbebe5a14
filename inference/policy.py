"""Request policy on /v1: every field a request sends is honoured or refused, never
silently dropped.

- A field that would change the output and that this server cannot honour (``functions``,
  a ``response_format`` type other than text, json_object and json_schema, ``audio``, …;
  the table ``UNHONOURED``) is refused
  with 400 ``field_not_honoured`` naming it, before anything is loaded or generated. Its
  neutral values (``null``, ``functions: []``, ``response_format: {"type": "text"}``, …) ask
  for what the server does anyway and pass.
- Every other field that nothing reads (``user``, ``metadata``, an unknown key, a key of a
  message the chat template never receives) is named in the response header
  ``X-miLLM-Ignored-Fields``, an RFC 8941 list of strings of locations
  (``"user", "messages[2].name"``), capped at ``IGNORED_HEADER_MAX_BYTES`` with a final
  ``"+N more"`` item.
- The request header ``X-miLLM-Strict: true`` (or ``1``) turns that list into 400
  ``unused_fields_refused``.

"Nothing reads" is decided against the parsed request: a key its wire model does not
declare (whatever its value, null included), or a declared field sent with a value that the
request itself says it leaves unread (``unread_fields``: e.g. ``max_tokens`` beside
``max_completion_tokens``, which wins).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from pydantic import BaseModel

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import check_template_kwargs
from inference.errors import OpenAIError
from inference.protocol import SERVICE_TIERS, ChatCompletionRequest, CompletionRequest
from inference.protocol_responses import ResponsesRequest
from inference.structured import SUPPORTED_TYPES
from inference.tools import check_tools

STRICT_HEADER = "X-miLLM-Strict"
IGNORED_HEADER = "X-miLLM-Ignored-Fields"
IGNORED_HEADER_MAX_BYTES = 1024
_STRICT_VALUES = {"true": True, "1": True, "false": False, "0": False}


def strict_mode(value: str | None) -> bool:
    """The ``X-miLLM-Strict`` request header: true/1 or false/0 (any case); absent = off."""
    if value is None:
        return False
    strict = _STRICT_VALUES.get(value.strip().lower())
    if strict is None:
        raise OpenAIError(
            f"{STRICT_HEADER} must be true, 1, false or 0 (got {value!r})",
            status=400,
            code="invalid_parameter",
            param=STRICT_HEADER,
        )
    return strict


# --------------------------------------------------------------------------- refusals


@dataclass(frozen=True)
class Unhonoured:
    """An output-changing field this server cannot honour, and its values that change
    nothing (``neutral(value, request)``)."""

    name: str
    why: str
    neutral: Callable[[Any, Any], bool]


def _one_of(*values: Any) -> Callable[[Any, Any], bool]:
    # equal and of the same type: ``0`` is not ``false``, ``[]`` is not ``{}``
    return lambda v, req: v is None or any(type(v) is type(x) and v == x for x in values)


def _known_format(value: Any, req: Any) -> bool:
    # honoured: text, and json_object / json_schema by constrained decoding (a schema
    # outside the supported subset is refused in check_fields: response_format_unsupported)
    return value is None or (isinstance(value, dict) and value.get("type") in SUPPORTED_TYPES)


def _best_of_n(value: Any, req: Any) -> bool:
    # best_of candidates of which the best n are returned: all of them when best_of == n
    return value is None or (type(value) is int and value == req.n)


# tools and tool_choice are honoured where the model's chat template renders tools
# (inference.tools); the deprecated function-calling fields are not
_TOOLS = "the deprecated function calling is not available; send tools and tool_choice"
_FORMATS = "the response formats are text, json_object and json_schema"
_TIERS = (
    Unhonoured(
        "service_tier",
        'the tiers are "auto" and "default" (interactive) and "flex" (behind interactive work); '
        "none runs ahead of interactive work",
        _one_of(*SERVICE_TIERS),
    ),
)
UNHONOURED: dict[type[BaseModel], tuple[Unhonoured, ...]] = {
    ChatCompletionRequest: (
        Unhonoured("functions", _TOOLS, _one_of([])),
        # without functions, "none" and "auto" call nothing: generated as asked
        Unhonoured("function_call", _TOOLS, _one_of("none", "auto")),
        Unhonoured("response_format", _FORMATS, _known_format),
        Unhonoured("audio", "audio output is not available", _one_of()),
        Unhonoured("modalities", "only text output is available", _one_of(["text"])),
        Unhonoured(
            "prediction",
            "predicted outputs (and the accepted/rejected prediction token counts they report) are not available",
            _one_of(),
        ),
        Unhonoured("web_search_options", "web search is not available", _one_of()),
        Unhonoured("moderation", "moderation of the input and output is not available", _one_of()),
        # OpenAI's values: none, minimal, low, medium, high, xhigh, max
        Unhonoured(
            "reasoning_effort",
            'the served model has no reasoning-effort control; only "none" is honoured',
            _one_of("none"),
        ),
        # OpenAI's values: low, medium, high
        Unhonoured(
            "verbosity",
            'verbosity control is not available; "medium" (the model\'s own) is honoured',
            _one_of("medium"),
        ),
        Unhonoured(
            "store",
            "stored chat completions are not available (there is no /v1/chat/completions/{id} to read them back)",
            _one_of(False),
        ),
        *_TIERS,
    ),
    CompletionRequest: (
        *_TIERS,
        Unhonoured("response_format", _FORMATS, _known_format),
        Unhonoured("suffix", "insertion (text after the completion) is not available", _one_of("")),
        Unhonoured("best_of", "ranking best_of candidates is not available; best_of must equal n", _best_of_n),
    ),
}


def _no_reasoning(value: Any, req: Any) -> bool:
    # a reasoning effort of none (or the default, on a model that does not reason), no summary
    return value is None or (
        isinstance(value, dict)
        and value.get("effort") in (None, "none")
        and value.get("summary") is None
        and value.get("generate_summary") is None
    )


# /v1/responses (inference.protocol_responses); its built-in tools, a tool_choice other than
# none/auto/required/a function, and text.verbosity are refused by inference.responses,
# naming the item
UNHONOURED[ResponsesRequest] = (
    *_TIERS,
    Unhonoured(
        "reasoning", 'the served model has no reasoning-effort control; only effort "none" is honoured', _no_reasoning
    ),
    Unhonoured("include", "none of the additional output data (logprobs, tool sources, …) is available", _one_of([])),
    Unhonoured(
        "truncation",
        'truncation is not available; "disabled" (a 400 past the context) is honoured',
        _one_of("disabled"),
    ),
    Unhonoured("prompt", "stored prompt templates are not available", _one_of()),
    Unhonoured("conversation", "conversations are not available; chain responses with previous_response_id", _one_of()),
    Unhonoured("context_management", "context management (compaction) is not available", _one_of()),
    Unhonoured("moderation", "moderation of the input and output is not available", _one_of()),
    Unhonoured("top_logprobs", "log-probabilities are not available on /v1/responses", _one_of(0)),
)


def refuse_unhonoured(data: dict[str, Any], req: BaseModel) -> None:
    """400 ``field_not_honoured`` for the first output-changing field ``data`` sends with a
    value this server cannot honour."""
    for rule in UNHONOURED.get(type(req), ()):
        if rule.name in data and not rule.neutral(data[rule.name], req):
            raise OpenAIError(
                f"{rule.name} cannot be honoured: {rule.why}", status=400, code="field_not_honoured", param=rule.name
            )


def check_cache_key(req: BaseModel) -> None:
    """``cache_salt`` (vLLM's name) is ``prompt_cache_key``'s alias: both sent and
    different is 400 ``invalid_parameter`` naming ``cache_salt``."""
    key, salt = getattr(req, "prompt_cache_key", None), getattr(req, "cache_salt", None)
    if key is not None and salt is not None and key != salt:
        raise OpenAIError(
            "cache_salt is prompt_cache_key's alias: send one of them, or the same value in both",
            status=400,
            code="invalid_parameter",
            param="cache_salt",
        )


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """``chat_template_kwargs`` as the engine gets them: a key the server sets itself
    (``add_generation_prompt``, ``tools``, ``messages``, …) is 400 ``invalid_parameter``
    naming it, and a request's own ``chat_template`` — Jinja the server would run — is
    refused unless MILLM_ALLOW_REQUEST_CHAT_TEMPLATE allows it."""
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        check_template_kwargs(kwargs)
    except InvalidParameter as exc:
        raise OpenAIError(str(exc), status=400, code="invalid_parameter", param=exc.param) from None
    if "chat_template" in kwargs and not settings.MILLM_ALLOW_REQUEST_CHAT_TEMPLATE:
        raise OpenAIError(
            "chat_template_kwargs.chat_template is refused: this server does "
            "not run chat templates sent with a request (the model's own "
            "template is used; the operator can allow them with "
            "MILLM_ALLOW_REQUEST_CHAT_TEMPLATE)",
            status=400,
            code="invalid_parameter",
            param="chat_template_kwargs.chat_template",
        )
    return kwargs


def check_dimensions(asked: int | None, native: int | None) -> None:
    """Embeddings ``dimensions``: the model's own size (its hidden size) is what the server
    returns anyway and passes; any other is 400 ``field_not_honoured``. ``native`` None:
    not known yet (checked again once the model is resident)."""
    if asked is not None and native is not None and asked != native:
        raise OpenAIError(
            f"dimensions cannot be honoured: embeddings have the model's hidden "
            f"size ({native}); shortening them is not available",
            status=400,
            code="field_not_honoured",
            param="dimensions",
        )


# --------------------------------------------------------------------------- unused


def _key(name: str) -> str:
    # printable ASCII as is; anything else JSON-escaped, so a location is plain ASCII
    # (an RFC 8941 string allows nothing else)
    return "".join(c if " " <= c <= "~" else json.dumps(c)[1:-1] for c in name)


def _walk(raw: dict[str, Any], parsed: BaseModel, path: str, checked: frozenset[str], out: list[str]) -> None:
    # a field is sent under its alias where it has one (``text.format.schema``)
    fields = {(info.alias or field): field for field, info in type(parsed).model_fields.items()}
    unread = parsed.unread_fields() if hasattr(parsed, "unread_fields") else frozenset()
    for name, value in raw.items():
        if name in checked:
            continue
        location = f"{path}.{_key(name)}" if path else _key(name)
        if name not in fields or (name in unread and value is not None):
            # (a declared field's null is "not given", unread or not)
            out.append(location)
        else:
            _descend(value, getattr(parsed, fields[name]), location, out)


def _descend(raw: Any, parsed: Any, location: str, out: list[str]) -> None:
    if isinstance(parsed, BaseModel) and isinstance(raw, dict):
        _walk(raw, parsed, location, frozenset(), out)
    elif isinstance(parsed, list) and isinstance(raw, list) and len(parsed) == len(raw):
        for i, (r, p) in enumerate(zip(raw, parsed, strict=True)):
            _descend(r, p, f"{location}[{i}]", out)


def unused_fields(data: dict[str, Any], req: BaseModel) -> list[str]:
    """The locations of the fields ``data`` sends that nothing reads, in body order."""
    out: list[str] = []
    checked = frozenset(rule.name for rule in UNHONOURED.get(type(req), ()))
    # the keys of another tool's steering shape were read as miLLM's (inference.steering_aliases)
    alias = getattr(req, "steering_alias", None)
    if alias is not None:
        checked |= frozenset(alias.keys)
    # the record is the server's own: a body that sends the key has it ignored
    checked |= {"steering_alias"}
    _walk(data, req, "", checked, out)
    sent = ["steering_alias"] if "steering_alias" in data and hasattr(req, "steering_alias") else []
    return out + sent + list(alias.ignored if alias is not None else ())


def _sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ignored_header_value(fields: Sequence[str], limit: int = IGNORED_HEADER_MAX_BYTES) -> str:
    """``fields`` as an RFC 8941 list of strings of at most ``limit`` bytes: as many as
    fit, then ``"+N more"`` for the rest."""
    items = [_sf_string(f) for f in fields]
    if sum(map(len, items)) + 2 * max(len(items) - 1, 0) <= limit:
        return ", ".join(items)
    prefix = [0]  # prefix[k]: bytes of the first k items joined with ", "
    for item in items:
        prefix.append(prefix[-1] + len(item) + (2 if len(prefix) > 1 else 0))
    for k in range(len(items) - 1, -1, -1):
        more = _sf_string(f"+{len(items) - k} more")
        if prefix[k] + (2 if k else 0) + len(more) <= limit:
            return ", ".join([*items[:k], more])
    raise AssertionError('the limit cannot hold even the "+N more" item')


def ignored_headers(fields: Sequence[str]) -> dict[str, str]:
    """The response header naming ``fields``, or none when there are none."""
    return {IGNORED_HEADER: ignored_header_value(fields)} if fields else {}


def check_fields(*, data: dict[str, Any], req: BaseModel, strict: bool) -> list[str]:
    """The request's field policy, before anything runs: refuses what cannot be honoured,
    and under ``strict`` what nothing reads; returns the unused locations otherwise."""
    refuse_unhonoured(data, req)
    check_cache_key(req)
    if hasattr(req, "structured"):
        req.structured()  # 400 response_format_unsupported, before anything is loaded
    if isinstance(req, ChatCompletionRequest):
        check_tools(req)  # tools' schemas and tool_choice, before anything is loaded
        template_kwargs(req)  # before anything is loaded too
    unused = unused_fields(data, req)
    if strict and unused:
        listed = ignored_header_value(unused)
        raise OpenAIError(
            f"{STRICT_HEADER} refuses fields this server does not read: {listed}",
            status=400,
            code="unused_fields_refused",
            param=unused[0],
            headers=ignored_headers(unused),
        )
    return unused
