"""A streamed ``POST /v1/responses``: the chat stream that computes it
(``inference.streaming.stream_choices``, whose frames it reads) re-framed as the
Responses API's typed events, each an SSE ``event:`` line and its ``data:``, numbered by
``sequence_number`` from 0:

``response.created``, ``response.in_progress``; for the text ``response.output_item.added``
(a ``message``), ``response.content_part.added``, ``response.output_text.delta`` …,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for each tool call ``response.output_item.added`` (a
``function_call``), ``response.function_call_arguments.delta`` (the whole arguments: a call
is sent once parsed, as on chat), ``response.function_call_arguments.done``,
``response.output_item.done``; then ``response.completed`` or ``response.incomplete``
(``max_output_tokens``) with the whole Response, its usage and its ``millm`` object (a
chat chunk's own ``millm``, were one sent with its text, rides on its delta event).
An error after the first event is an ``error`` event, then ``response.failed``. With
``stream_options.include_obfuscation`` the delta events carry chat's ``obfuscation`` padding.

The Response is stored (``save_response``) before its last event is sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from inference.errors import OpenAIError, openai_error_from_exception
from inference.responses_shape import call_item, failed, finished, item_id, message_item, text_part
from inference.streaming import obfuscation


def _frames(blob: bytes) -> list[Any]:
    """The payloads of the chat stream's SSE frames in one write ("[DONE]" as is)."""
    out: list[Any] = []
    for frame in blob.split(b"\n\n"):
        if frame.startswith(b"data: "):
            payload = frame[len(b"data: ") :]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


# the delta events ``stream_options.include_obfuscation`` pads (OpenAI's ``obfuscation``)
_DELTAS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


class _Events:
    """The typed events of one Response, numbered."""

    def __init__(self, obfuscate: bool = False) -> None:
        self.sequence = 0
        self.obfuscate = obfuscate

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        if self.obfuscate and kind in _DELTAS:  # padded as chat pads its chunks
            data["obfuscation"] = obfuscation(data)
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class _Message:
    """The assistant message under way: its id, place in ``output`` and text so far."""

    def __init__(self, index: int) -> None:
        self.id = item_id("msg")
        self.index = index
        self.text = ""


async def response_events(
    skeleton: dict[str, Any],
    chunks: AsyncIterator[bytes],
    *,
    model: str,
    save: Callable[[dict[str, Any]], Awaitable[None]],
    obfuscate: bool = False,
) -> AsyncIterator[bytes]:
    event = _Events(obfuscate)
    output: list[dict[str, Any]] = []
    message: _Message | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    millm: dict[str, Any] | None = None

    def open_message() -> list[bytes]:
        nonlocal message
        message = _Message(len(output))
        output.append(message_item(message.id, "", "in_progress") | {"content": []})
        return [
            event("response.output_item.added", output_index=message.index, item=output[message.index]),
            event(
                "response.content_part.added",
                item_id=message.id,
                output_index=message.index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def close_message(status: str) -> list[bytes]:
        nonlocal message
        if message is None:
            return []
        done, message = message, None
        output[done.index] = message_item(done.id, done.text, status)
        where = {"item_id": done.id, "output_index": done.index, "content_index": 0}
        return [
            event("response.output_text.done", **where, text=done.text, logprobs=[]),
            event("response.content_part.done", **where, part=text_part(done.text)),
            event("response.output_item.done", output_index=done.index, item=output[done.index]),
        ]

    def call(chat_call: dict[str, Any]) -> list[bytes]:
        item = call_item(chat_call)
        index = len(output)
        output.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return [
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]),
            event("response.output_item.done", output_index=index, item=item),
        ]

    async def fail(error: OpenAIError) -> AsyncIterator[bytes]:
        yield event("error", code=error.code, message=error.message, param=error.param)
        body = failed(skeleton, code="server_error", message=f"{error.code}: {error.message}", output=output)
        try:
            await save(body)
        except Exception:  # noqa: BLE001, S110 - the stream has failed already; its event says so
            pass
        yield event("response.failed", response=body)

    yield event("response.created", response=skeleton)
    yield event("response.in_progress", response=skeleton)
    try:
        async with aclosing(chunks):
            async for blob in chunks:
                out: list[bytes] = []
                for payload in _frames(blob):
                    if payload == "[DONE]":
                        continue
                    if "error" in payload:
                        error = payload["error"]
                        out += close_message("incomplete")
                        yield b"".join(out)
                        async for frame in fail(
                            OpenAIError(
                                error.get("message", ""),
                                status=500,
                                code=error.get("code") or "generation_failed",
                                param=error.get("param"),
                            )
                        ):
                            yield frame
                        return
                    extension = payload.get("millm")
                    if extension is not None and not payload.get("choices"):
                        millm = extension  # the request's millm object, after its tokens
                        extension = None
                    usage = payload.get("usage") or usage
                    for choice in payload.get("choices", ()):
                        delta = choice.get("delta") or {}
                        if delta.get("content"):
                            if message is None:
                                out += open_message()
                            assert message is not None
                            message.text += delta["content"]
                            out.append(
                                event(
                                    "response.output_text.delta",
                                    item_id=message.id,
                                    output_index=message.index,
                                    content_index=0,
                                    delta=delta["content"],
                                    logprobs=[],
                                    # a chunk's own extension, where chat sends one
                                    **({} if extension is None else {"millm": extension}),
                                )
                            )
                        for chat_call in delta.get("tool_calls") or ():
                            out += close_message("completed")
                            out += call(chat_call)
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                if out:
                    yield b"".join(out)
    except Exception as exc:  # noqa: BLE001 - after the first event an error is an event
        async for frame in fail(openai_error_from_exception(exc)):
            yield frame
        return
    cut = finish == "length"
    closing: list[bytes] = []
    if message is None and not output:
        closing += open_message()  # an empty answer is an empty message, as unstreamed
    closing += close_message("incomplete" if cut else "completed")
    body = finished(skeleton, model=model, output=output, cut=cut, usage=usage, millm=millm)
    try:
        await save(body)
    except OpenAIError as error:
        yield b"".join(closing)
        async for frame in fail(error):
            yield frame
        return
    yield b"".join([*closing, event("response.incomplete" if cut else "response.completed", response=body)])
