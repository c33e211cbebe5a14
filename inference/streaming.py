"""A /v1 generation request answered as an SSE stream: its chunks in OpenAI's shapes, the
choices sent one after another (all submitted to the engine with the first), and the slot
and model use it holds released exactly once, when Django closes the response — even one
never iterated. After the first byte an error is a frame, then ``[DONE]``."""

from __future__ import annotations

import asyncio
import json
import secrets
import string
from collections.abc import AsyncIterator, Callable
from typing import Any

from django.http import StreamingHttpResponse

from core.engine_client import EngineClient
from gpu_engine.api.protocol import ErrorEvent, FinishEvent, TokenEvent
from inference import wire
from inference.admission import Permit
from inference.errors import (
    OpenAIError,
    openai_error_event,
    openai_error_frame,
    openai_error_from_exception,
)
from inference.fidelity import measure_fidelity
from inference.outcomes import (
    Outcome,
    label_activations,
    outcome_of,
    record_monitoring,
    register_capture,
    run_analyses,
    score_probes,
    sense,
)
from inference.planning import Choice, Plan
from inference.protocol import CompletionRequest
from inference.residency import Use
from inference.shaping import (
    chat_finish_reason,
    count_usage,
    millm_object,
    top_dict,
    usage_of,
    wants_millm,
)
from inference.tools import ToolStream


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingHttpResponse):
    """An SSE stream whose resources (slot, model use, engine generation) are released
    when Django closes the response, even if the stream was never iterated (a client
    that left before the first byte)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, content_type="text/event-stream", headers=headers)
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"
        self._on_close = on_close

    def close(self) -> None:
        try:
            self._on_close()
        finally:
            super().close()


class Submitted:
    """A choice's events, submitted to the engine now and read later. A stream sends its
    choices one after another, but every choice reaches the engine with the first (as the
    JSON answer's do), so all of them are work the engine had accepted when an unload's or
    a shutdown's grace period began (submitted only when its turn came, choice 2 was new
    work and refused). Closing it cancels the generation."""

    _END = object()

    def __init__(self, events: AsyncIterator[Any]) -> None:
        self._events = events
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for event in self._events:
                self._queue.put_nowait(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait(exc)
        self._queue.put_nowait(self._END)

    def __aiter__(self) -> Submitted:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self._task.cancel()  # inside the engine stream: cancels the generation
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class Resources:
    """The slot and the model use a request holds, released exactly once."""

    def __init__(self, permit: Permit, use: Use | None = None, quota: Any = None) -> None:
        self.permit = permit
        self.use = use
        self.quota = quota  # the key's quota ticket (inference.quotas), released here
        if quota is not None:
            quota.owned = True
        self.events: Any = None
        self.later: list[Submitted] = []  # a stream's choices after the first
        self.loop: asyncio.AbstractEventLoop | None = None

    def release(self) -> None:
        events, self.events = self.events, None
        later, self.later = self.later, []
        streams = [e for e in (events, *later) if e is not None]
        if streams and self.loop is not None and not self.loop.is_closed():
            # Called from Django's response-closing thread: close the engine streams on
            # their loop (cancels the generations); harmless if they already finished.
            async def close() -> None:
                for stream in streams:
                    try:
                        await stream.aclose()
                    except (RuntimeError, StopAsyncIteration):
                        pass

            try:
                asyncio.run_coroutine_threadsafe(close(), self.loop)
            except RuntimeError:
                pass
        if self.use is not None:
            self.use.release()
        self.permit.release()
        if self.quota is not None:
            self.quota.release()


def _chunk(
    plan: Plan, choices: list[Any], *, usage: wire.Usage | None = None, millm: dict[str, Any] | None = None
) -> dict[str, Any]:
    common: dict[str, Any] = {
        "id": plan.object_id,
        "created": plan.created,
        "model": plan.model.name,
        "system_fingerprint": plan.fingerprint,
        "choices": choices,
        "usage": usage,
        "millm": millm,
    }
    if plan.kind == "chat":
        data = wire.ChatCompletionChunk(**common, service_tier=plan.request.answered_tier).dump()
    else:
        data = wire.Completion(**common).dump()
    if plan.request.include_usage:
        data.setdefault("usage", None)  # null on every chunk but the usage one
    else:
        data.pop("usage", None)
    if plan.request.obfuscate and choices:
        data["obfuscation"] = obfuscation(data)
    return data


OBFUSCATION_BLOCK = 64
_OBFUSCATION_ALPHABET = string.ascii_letters + string.digits
# ',"obfuscation":""' — what the field adds to the compact JSON besides its characters
_OBFUSCATION_OVERHEAD = 17


def obfuscation(data: dict[str, Any]) -> str:
    """``stream_options.include_obfuscation``: random characters that pad the chunk's
    compact JSON to a multiple of ``OBFUSCATION_BLOCK`` bytes (at least one), so a
    delta's size on the wire no longer tells its text's length within a block."""
    size = len(json.dumps(data, separators=(",", ":")).encode()) + _OBFUSCATION_OVERHEAD + 1
    pad = 1 + (-size) % OBFUSCATION_BLOCK
    return "".join(secrets.choice(_OBFUSCATION_ALPHABET) for _ in range(pad))


def _token_choice(
    plan: Plan, choice: Choice, event: TokenEvent, tool_stream: ToolStream | None = None, text_offset: int = 0
) -> Any:
    """A token's chunk choice; ``text_offset``: where the token's text starts, counted
    as in the non-streamed answer (the texts of the choice's earlier tokens)."""
    text = event.text if tool_stream is None else tool_stream.feed(event.text)
    if not text and event.logprob is None:
        return None
    if plan.kind == "chat":
        logprobs = (
            wire.ChatLogprobs(content=[wire.ChatTokenLogprob.of(event.logprob)])
            if event.logprob is not None and plan.request.logprobs
            else None
        )
        if not text and logprobs is None:
            return None
        return wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(content=text), logprobs=logprobs)
    logprobs = None
    if event.logprob is not None:
        logprobs = wire.CompletionLogprobs(
            tokens=[event.logprob.token],
            token_logprobs=[event.logprob.logprob],
            top_logprobs=[top_dict(event.logprob)],
            text_offset=[text_offset],
        )
    return wire.CompletionChoice(index=choice.index, text=event.text, logprobs=logprobs, finish_reason=None)


def _tool_chunks(choice: Choice, tool_stream: ToolStream) -> list[Any]:
    """The held text and each parsed call (a whole call in one delta) of a streamed
    choice under tools, at its finish."""
    rest, calls = tool_stream.finish()
    out: list[Any] = []
    if rest:
        out.append(wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(content=rest)))
    for i, call in enumerate(calls):
        out.append(
            wire.ChatChunkChoice(
                index=choice.index, delta=wire.ChatDelta(tool_calls=[wire.ToolCallDelta(index=i, **call)])
            )
        )
    return out


def _finish_choice(plan: Plan, choice: Choice, finish: FinishEvent) -> Any:
    if plan.kind == "chat":
        return wire.ChatChunkChoice(
            index=choice.index, delta=wire.ChatDelta(), finish_reason=chat_finish_reason(plan, finish)
        )
    reason = wire.finish_reason(finish.finish_reason)
    return wire.CompletionChoice(index=choice.index, text="", logprobs=None, finish_reason=reason)


def _opening(plan: Plan, choice: Choice, first_prompt_text: str | None) -> Any:
    if plan.kind == "chat":
        return wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(role="assistant", content=""))
    req = plan.request
    if isinstance(req, CompletionRequest) and req.echo:
        text = choice.prompt_text if choice.prompt_text is not None else first_prompt_text or ""
        return wire.CompletionChoice(index=choice.index, text=text, logprobs=None, finish_reason=None)
    return None


async def stream_choices(
    plan: Plan, client: EngineClient, res: Resources, first: TokenEvent | FinishEvent
) -> AsyncIterator[bytes]:
    outcomes: list[Outcome] = []
    under_way: list[TokenEvent] = []  # the tokens sent of a choice not finished yet
    try:
        for position, choice in enumerate(plan.choices):
            if position == 0:
                pending: TokenEvent | FinishEvent | ErrorEvent | None = first
            else:
                res.events = res.later[position - 1]
                pending = None
            opened = False
            held = b""
            offset = 0  # the characters of this choice's tokens so far (text_offset)
            tokens: list[TokenEvent] = []
            under_way = [] if choice.prompt_only else tokens  # what was sent
            tool_stream = (
                ToolStream(plan.tools) if plan.kind == "chat" and plan.tools is not None and plan.tools.parses else None
            )
            while True:
                if pending is None:
                    try:
                        event = await anext(res.events)
                    except StopAsyncIteration:
                        raise OpenAIError(
                            "the generation ended without a result",
                            status=500,
                            code="generation_failed",
                            type="server_error",
                        ) from None
                else:
                    event, pending = pending, None
                if isinstance(event, ErrorEvent):
                    yield held + openai_error_frame(openai_error_event(event.code, event.message, event.details))
                    return
                if not opened:
                    opened = True
                    # the engine sends the prompt's text with the first token (or at the
                    # finish of a generation that made none) when echo asked for it
                    opening = _opening(plan, choice, event.prompt_text)
                    # sent with the first token, in one write
                    held = _sse(_chunk(plan, [opening])) if opening is not None else b""
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                    if choice.prompt_only:
                        continue  # max_tokens 0: the prefill's token is never sent
                    piece = _token_choice(plan, choice, event, tool_stream, offset)
                    if event.logprob is not None:
                        offset += len(event.logprob.token)
                    if piece is not None:
                        yield held + _sse(_chunk(plan, [piece]))
                        held = b""
                elif isinstance(event, FinishEvent):
                    outcomes.append(outcome_of(choice, event, tokens))
                    under_way = []
                    await measure_fidelity(plan, outcomes[-1], client)
                    await record_monitoring(plan, outcomes[-1])
                    await register_capture(plan, outcomes[-1])
                    await score_probes(plan, outcomes[-1])
                    sense(plan, outcomes[-1])
                    if tool_stream is not None:
                        for piece in _tool_chunks(choice, tool_stream):
                            yield held + _sse(_chunk(plan, [piece]))
                            held = b""
                    yield held + _sse(_chunk(plan, [_finish_choice(plan, choice, outcomes[-1].finish)]))
                    held = b""
                    break
        if wants_millm(plan, outcomes):
            if outcomes:
                await run_analyses(plan, outcomes[0])  # after the tokens, before [DONE]
                await label_activations(plan, outcomes[0])
            yield _sse(_chunk(plan, [], millm=millm_object(plan, outcomes)))
        if plan.request.include_usage:
            # last before [DONE]: OpenAI clients read the usage from the last chunk
            yield _sse(_chunk(plan, [], usage=usage_of(plan, outcomes)))
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # noqa: BLE001 - after the first byte an error is a frame
        yield openai_error_frame(openai_error_from_exception(exc))
    finally:
        try:
            # counted however the stream ended (a client that hung up was sent tokens
            # too), and before the slot is freed: an idle server has counted everything
            count_usage(plan, usage_of(plan, outcomes), unfinished=len(under_way), outcomes=outcomes)
        finally:
            res.release()
