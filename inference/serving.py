"""Serving one /v1 generation request: admission, residency, the engine jobs, and the
response — a JSON body or an SSE stream. What the request does (its model, steering,
monitoring and jobs: the ``Plan``) is decided before the first token, in
``inference.planning``.

Views stay thin (``inference.views``); everything that decides what a request does is
here, in ``inference.planning`` or in the resolvers it calls (``steering.services``,
``inference.activations``).
The engine is reached only through ``EngineClient`` (``agenerate`` for generation, other
calls on a worker thread), so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog
from django.http import JsonResponse, StreamingHttpResponse

from core.engine_client import EngineClient, arrived
from core.metrics import record_speculative, record_tokens
from core.runtime import runtime
from gpu_engine.api.protocol import (
    ErrorEvent,
    FinishEvent,
    SteeringCount,
    TokenEvent,
    TokenLogprob,
    Usage,
    to_builtins,
)
from inference import wire
from inference.activations import activations_payload
from inference.admission import Permit
from inference.errors import (
    OpenAIError,
    openai_error_event,
    openai_error_frame,
    openai_error_from_exception,
)
from inference.planning import Choice, Plan, off_view_thread, plan_generation, resolve_model
from inference.protocol import ChatCompletionRequest, CompletionRequest
from inference.residency import Use, resident_model_id
from inference.scoring import check_scoring, serve_scoring
from inference.tools import ToolStream, parse_tool_calls, refuse_tools_before_load
from monitoring.ownership import EVERYONE, Scope
from monitoring.probes import (
    ProbePlan,
    probe_record,
    probe_score_hidden,
    probe_score_sae,
    probe_take_records,
    verdicts_header,
)
from monitoring.sensing import sensing_publish, sensing_take_records
from monitoring.services import capture_register, monitoring_record, monitoring_take_records

log = structlog.get_logger(__name__)

ENGINE_CALL_TIMEOUT_S = 300.0


@dataclass
class Outcome:
    """One finished choice."""

    choice: Choice
    finish: FinishEvent
    tokens: list[TokenEvent]
    capture: dict[str, Any] | None = None  # millm.capture (register_capture)
    analysis: list[dict[str, Any]] | None = None  # millm.analysis (run_analyses)
    probes: list[dict[str, Any]] | None = None  # millm.probes (score_probes)


# --------------------------------------------------------------------------- shaping

def _top_dict(lp: TokenLogprob) -> dict[str, float]:
    # OpenAI's legacy shape; like vLLM, the chosen token is always among them
    top = {t.token: t.logprob for t in lp.top_logprobs}
    top.setdefault(lp.token, lp.logprob)
    return top


def _sum_counts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    totals: dict[tuple[str, int], SteeringCount] = {}
    for out in outcomes:
        for c in out.finish.steering_apply_count:
            total = totals.setdefault((c.sae_id, c.layer), SteeringCount(c.sae_id, c.layer, 0))
            total.count += c.count
            for mode, n in c.modes.items():
                total.modes[mode] = total.modes.get(mode, 0) + n
    return to_builtins(list(totals.values()))


def _fired(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Where each choice's conditional controls fired: row positions, and the completion
    tokens those rows produced (row ``P - 1 + i`` produces token ``i``)."""
    out: list[dict[str, Any]] = []
    for o in outcomes:
        last_prompt_row = len(o.finish.prompt_token_ids) - 1
        for f in o.finish.steering_fired:
            out.append({"choice": o.choice.index, "sae_id": f.sae_id, "layer": f.layer,
                        "index": f.index, "mode": f.mode, "positions": list(f.positions),
                        "token_indices": [p - last_prompt_row for p in f.positions
                                          if p >= last_prompt_row]})
    return out


def _speculative(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """SPECULATIVE_MODEL's figures over the request's choices: the drafts proposed and
    accepted, or why the request decoded without them."""
    stats = [o.finish.speculative for o in outcomes if o.finish.speculative is not None]
    if not stats:
        return None
    used = [s for s in stats if s.used]
    drafted, accepted = sum(s.drafted for s in used), sum(s.accepted for s in used)
    out: dict[str, Any] = {"used": bool(used), "source": stats[0].source,
                           "num_tokens": stats[0].num_tokens, "drafted": drafted,
                           "accepted": accepted,
                           "acceptance_rate": round(accepted / drafted, 4) if drafted else None}
    if not used:
        out["reason"] = stats[0].reason
    return out


def wants_millm(plan: Plan, outcomes: list[Outcome]) -> bool:
    """The response carries the ``millm`` object: the request used an extension, or the
    model decodes speculatively (its acceptance figures)."""
    return plan.wants_millm or any(o.finish.speculative is not None for o in outcomes)


def millm_object(plan: Plan, outcomes: list[Outcome]) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "steering": plan.steering.summary(),
        "steering_apply_count": _sum_counts(outcomes),
        "forward_passes": sum(o.finish.forward_passes for o in outcomes),
    }
    speculative = _speculative(outcomes)
    if speculative is not None:
        obj["speculative"] = speculative
    fired = _fired(outcomes)
    if fired:
        obj["steering_fired"] = fired
    if outcomes and outcomes[0].capture is not None and plan.request.capture is not None:
        # the capture the request asked for; one its analyzers alone armed is not sent
        obj["capture"] = outcomes[0].capture
    if outcomes and outcomes[0].analysis is not None:
        obj["analysis"] = outcomes[0].analysis
    if plan.probes is not None:
        obj["probes"] = [v for o in outcomes for v in (o.probes or [])]
    if plan.monitor is not None and plan.attachment is not None and outcomes:
        out = outcomes[0]
        records = list(out.finish.activations)
        for t in out.tokens:
            records.extend(t.activations)
        obj["sae_activations"] = activations_payload(
            records=records, attachment=plan.attachment,
            read_point=plan.monitor.entries[0].read_point,
            prompt_ids=out.finish.prompt_token_ids, token_ids=out.finish.token_ids,
            prompt_tokens=out.finish.prompt_tokens, tokens=out.finish.tokens)
    return obj


def usage_of(plan: Plan, outcomes: list[Outcome]) -> wire.Usage:
    prompt = 0
    seen: set[int] = set()
    n = plan.request.n
    for out in outcomes:
        group = out.choice.index // n  # choices of one prompt share their prompt tokens
        if group not in seen:
            seen.add(group)
            prompt += out.finish.usage.prompt_tokens
    completion = sum(o.finish.usage.completion_tokens for o in outcomes)
    return wire.Usage(prompt_tokens=prompt, completion_tokens=completion,
                      total_tokens=prompt + completion)


def count_usage(plan: Plan, usage: wire.Usage, *, unfinished: int = 0,
                outcomes: list[Outcome] | None = None) -> None:
    """Advance the token counters once per answered request, by the usage it reports
    (plus the tokens a stream sent for a choice that never finished), and the speculative
    decoding counters by its choices' drafts."""
    record_tokens(model=plan.model.name,
                  completion_tokens=usage.completion_tokens + unfinished,
                  prompt_tokens=usage.prompt_tokens)
    speculative = _speculative(outcomes or [])
    if speculative is not None and speculative["used"]:
        record_speculative(model=plan.model.name, drafted=speculative["drafted"],
                           accepted=speculative["accepted"])


def _text_offsets(tokens: list[str], text: str) -> list[int]:
    """Where each token starts in the choice's ``text`` (OpenAI's ``text_offset``): a token
    whose text is not there at that point (a BOS ``<s>`` the echoed prompt leaves out, a
    piece of a multi-byte character) starts where the next would and takes no room."""
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        if token and text.startswith(token, pos):
            pos += len(token)
    return offsets


def _completion_logprobs(plan: Plan, out: Outcome, text: str) -> wire.CompletionLogprobs:
    req = plan.request
    assert isinstance(req, CompletionRequest)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if req.echo:
        # the prompt's own logprobs and, with logprobs >= 1, the alternatives at each
        # position: both from the request's prefill (steered as the request is)
        n_prompt = len(out.finish.prompt_token_ids)
        tokens += list(out.finish.prompt_tokens)
        token_logprobs += list(out.finish.prompt_logprobs or [None] * n_prompt)
        alternatives = out.finish.prompt_top_logprobs or [None] * n_prompt
        for i, entries in enumerate(alternatives):
            if i == 0:
                top.append(None)
                continue
            alt = {e.token: e.logprob for e in entries or ()}
            lp = token_logprobs[i]
            if lp is not None:
                alt.setdefault(tokens[i], lp)  # as for completion tokens: the chosen one too
            top.append(alt)
    for t in out.tokens:
        if t.logprob is None:
            continue
        tokens.append(t.logprob.token)
        token_logprobs.append(t.logprob.logprob)
        top.append(_top_dict(t.logprob))
    return wire.CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                                   top_logprobs=top, text_offset=_text_offsets(tokens, text))


def build_body(plan: Plan, outcomes: list[Outcome]) -> dict[str, Any]:
    millm = millm_object(plan, outcomes) if wants_millm(plan, outcomes) else None
    common = {"id": plan.object_id, "created": plan.created, "model": plan.model.name,
              "system_fingerprint": plan.fingerprint, "usage": usage_of(plan, outcomes),
              "millm": millm}
    if plan.kind == "chat":
        wants = bool(getattr(plan.request, "logprobs", False))
        return wire.ChatCompletion(**common, choices=[wire.ChatChoice(
            index=out.choice.index,
            message=chat_message(plan, out.finish.text),
            logprobs=wire.ChatLogprobs(content=[wire.ChatTokenLogprob.of(t.logprob)
                                                for t in out.tokens
                                                if t.logprob is not None]) if wants else None,
            finish_reason=chat_finish_reason(plan, out.finish))
            for out in outcomes]).dump()
    req = plan.request
    assert isinstance(req, CompletionRequest)
    choices = []
    for out in outcomes:
        text = out.finish.text
        if req.echo:
            text = (out.choice.prompt_text if out.choice.prompt_text is not None
                    else out.finish.prompt_text or "") + text
        choices.append(wire.CompletionChoice(
            index=out.choice.index, text=text,
            logprobs=_completion_logprobs(plan, out, text) if req.wants_logprobs else None,
            finish_reason=wire.finish_reason(out.finish.finish_reason)))
    return wire.Completion(**common, choices=choices).dump()


def chat_message(plan: Plan, text: str) -> wire.ChatMessage:
    """A chat choice's message: its text, or under tools the calls parsed out of it
    (``content`` null when nothing but calls)."""
    if plan.tools is None or not plan.tools.parses:
        return wire.ChatMessage(content=text)
    content, calls = parse_tool_calls(text, plan.tools)
    if not calls:
        return wire.ChatMessage(content=text)
    return wire.ChatMessage(content=content.strip() or None,
                            tool_calls=[wire.ToolCall(**c) for c in calls])


def chat_finish_reason(plan: Plan, finish: FinishEvent) -> wire.FinishReason:
    calls = plan.tools is not None and plan.tools.parses and \
        bool(parse_tool_calls(finish.text, plan.tools)[1])
    return wire.finish_reason(finish.finish_reason, tool_calls=calls)


# --------------------------------------------------------------------------- running

async def record_monitoring(plan: Plan, outcome: Outcome) -> None:
    """Hand /api/monitoring's records of a finished choice to the monitoring history
    (taken out of the outcome, so return_sae_activations never sees them)."""
    if plan.monitoring is None:
        return
    records = monitoring_take_records(entry=plan.monitoring, finish=outcome.finish,
                                      tokens=outcome.tokens)
    await off_view_thread(monitoring_record)(request_id=plan.object_id,
                                             entry=plan.monitoring, records=records,
                                             owner=plan.scope.owner)


async def register_capture(plan: Plan, outcome: Outcome) -> None:
    """``millm.capture`` of a finished choice: the artifact inline (base64), or the
    ``Capture`` row of one the engine stored, fetched by id from /api/captures."""
    result = outcome.finish.capture
    if result is None:
        return
    if result.data is not None:
        outcome.capture = {"id": result.capture_id, "inline": True, "format": "safetensors",
                           "bytes": result.nbytes, "data": base64.b64encode(result.data).decode(),
                           "metadata": result.meta}
        return
    await off_view_thread(capture_register)(request_id=plan.object_id, result=result,
                                            owner=plan.scope.owner)
    outcome.capture = {"id": result.capture_id, "inline": False, "format": "safetensors",
                       "bytes": result.nbytes, "url": f"/api/captures/{result.capture_id}/download"}


async def run_analyses(plan: Plan, outcome: Outcome) -> None:
    """``millm.analysis`` of a finished choice: each analyzer of ``analyze`` on the
    capture it armed, where analyses run (``monitoring.analysis``: the process's pool
    embedded, the Celery analysis queue distributed; off the event loop and the engine's
    decode loop; after ``register_capture``, which stores the row of a stored capture)."""
    if not plan.analyses:
        return
    result = outcome.finish.capture
    source: Any = None
    if result is not None:
        if result.data is not None:
            source = result.data
        else:
            source = Path(outcome.choice.job.capture.directory or "") / (result.file or "")
    entries = await runtime().analyzers.arun(
        plan.analyses, source, capture_id=result.capture_id if result is not None else None)
    if result is not None and result.data is None:
        # stored: /api/captures/{id}/analyze can run another analyzer on it later
        entries = [{**e, "capture_id": result.capture_id} for e in entries]
    outcome.analysis = entries


async def probe_verdicts(probes: ProbePlan, outcome: Outcome, *, rows: str = "completion"
                         ) -> list[dict[str, Any]]:
    """The verdicts of a finished choice (``monitoring.probes``): SAE-feature probes from
    the records their monitors made (taken out first, so ``return_sae_activations`` never
    sees them), hidden-state probes from the capture in the analysis pool. ``rows``: the
    rows the monitors and capture were asked for (a generation's ``completion`` rows, a
    scoring pass's ``prompt`` rows). After ``register_capture``."""
    index = outcome.choice.index
    records = probe_take_records(finish=outcome.finish, tokens=outcome.tokens)
    verdicts = [h.skipped(r, index) for h, r in zip(probes.skipped, probes.reasons)]
    verdicts += probe_score_sae(heads=[h for h in probes.heads if h.basis == "sae_features"],
                                records=records, choice=index)
    if probes.hidden:
        result = outcome.finish.capture
        source: Any = None
        if result is not None:
            source = result.data if result.data is not None else \
                Path(outcome.choice.job.capture.directory or "") / (result.file or "")
        verdicts += await runtime().analyzers.acall(probe_score_hidden, probes.hidden,
                                                    source, index, rows)
    order = {h.id: i for i, h in enumerate([*probes.skipped, *probes.heads])}
    return sorted(verdicts, key=lambda v: order.get(v["probe_id"], 0))


async def score_probes(plan: Plan, outcome: Outcome) -> None:
    """``millm.probes`` of a finished choice (``probe_verdicts``); then the verdicts go to
    the probe history."""
    if plan.probes is None:
        return
    outcome.probes = await probe_verdicts(plan.probes, outcome)
    await off_view_thread(probe_record)(request_id=plan.object_id, verdicts=outcome.probes,
                                        owner=plan.scope.owner)


def sense(plan: Plan, outcome: Outcome) -> None:
    """Sensing of a finished choice (``monitoring.sensing``): its records taken out of the
    outcome (``return_sae_activations`` never sees them), then one ``sensing:*`` event per
    watched document that fired. Nothing in the response changes."""
    if plan.sensing is None:
        return
    records = sensing_take_records(finish=outcome.finish, tokens=outcome.tokens)
    sensing_publish(plan=plan.sensing, records=records, request_id=plan.object_id,
                    choice=outcome.choice.index, owner=plan.scope.owner)


def probe_headers(plan: Plan, outcomes: list[Outcome]) -> dict[str, str]:
    if plan.probes is None or not outcomes or not outcomes[0].probes:
        return {}
    return {"X-miLLM-Probe-Verdicts": verdicts_header(outcomes[0].probes)}


def prompt_only(choice: Choice, finish: FinishEvent, tokens: list[TokenEvent]) -> Outcome:
    """A ``max_tokens: 0`` choice's outcome: the prompt read (its echo, logprobs and
    activations) and nothing generated — the one token the engine's prefill produced is
    dropped, and the monitor rows that travelled with it stay as prompt rows."""
    records = [msgspec.structs.replace(r, token_index=None)
               for r in [*finish.activations, *(r for t in tokens for r in t.activations)]]
    n = finish.usage.prompt_tokens
    return Outcome(choice, msgspec.structs.replace(
        finish, finish_reason="length", text="", token_ids=[], tokens=[],
        usage=Usage(n, 0, n), activations=records), [])


def outcome_of(choice: Choice, finish: FinishEvent, tokens: list[TokenEvent]) -> Outcome:
    return prompt_only(choice, finish, tokens) if choice.prompt_only \
        else Outcome(choice, finish, tokens)


async def run_choice(client: EngineClient, choice: Choice) -> Outcome:
    tokens: list[TokenEvent] = []
    async for event in client.agenerate(choice.job):
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, FinishEvent):
            return outcome_of(choice, event, tokens)
        elif isinstance(event, ErrorEvent):
            raise openai_error_event(event.code, event.message, event.details)
    raise OpenAIError("the generation ended without a result", status=500,
                      code="generation_failed", type="server_error")


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingHttpResponse):
    """An SSE stream whose resources (slot, model use, engine generation) are released
    when Django closes the response, even if the stream was never iterated (a client
    that left before the first byte)."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], None],
                 headers: dict[str, str]) -> None:
        super().__init__(content, content_type="text/event-stream", headers=headers)
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"
        self._on_close = on_close

    def close(self) -> None:
        try:
            self._on_close()
        finally:
            super().close()


class _Submitted:
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

    def __aiter__(self) -> _Submitted:
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


class _Resources:
    """The slot and the model use a request holds, released exactly once."""

    def __init__(self, permit: Permit, use: Use | None = None) -> None:
        self.permit = permit
        self.use = use
        self.events: Any = None
        self.later: list[_Submitted] = []  # a stream's choices after the first
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


def _chunk(plan: Plan, choices: list[Any], *, usage: wire.Usage | None = None,
           millm: dict[str, Any] | None = None) -> dict[str, Any]:
    model = wire.ChatCompletionChunk if plan.kind == "chat" else wire.Completion
    data = model(id=plan.object_id, created=plan.created, model=plan.model.name,
                 system_fingerprint=plan.fingerprint, choices=choices, usage=usage,
                 millm=millm).dump()
    if plan.request.include_usage:
        data.setdefault("usage", None)  # null on every chunk but the usage one
    else:
        data.pop("usage", None)
    return data


def _token_choice(plan: Plan, choice: Choice, event: TokenEvent,
                  tool_stream: ToolStream | None = None, text_offset: int = 0) -> Any:
    """A token's chunk choice; ``text_offset``: where the token's text starts, counted
    as in the non-streamed answer (the texts of the choice's earlier tokens)."""
    text = event.text if tool_stream is None else tool_stream.feed(event.text)
    if not text and event.logprob is None:
        return None
    if plan.kind == "chat":
        logprobs = (wire.ChatLogprobs(content=[wire.ChatTokenLogprob.of(event.logprob)])
                    if event.logprob is not None and plan.request.logprobs else None)
        if not text and logprobs is None:
            return None
        return wire.ChatChunkChoice(index=choice.index,
                                    delta=wire.ChatDelta(content=text),
                                    logprobs=logprobs)
    logprobs = None
    if event.logprob is not None:
        logprobs = wire.CompletionLogprobs(
            tokens=[event.logprob.token], token_logprobs=[event.logprob.logprob],
            top_logprobs=[_top_dict(event.logprob)], text_offset=[text_offset])
    return wire.CompletionChoice(index=choice.index, text=event.text, logprobs=logprobs,
                                 finish_reason=None)


def _tool_chunks(choice: Choice, tool_stream: ToolStream) -> list[Any]:
    """The held text and each parsed call (a whole call in one delta) of a streamed
    choice under tools, at its finish."""
    rest, calls = tool_stream.finish()
    out: list[Any] = []
    if rest:
        out.append(wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(content=rest)))
    for i, call in enumerate(calls):
        out.append(wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(
            tool_calls=[wire.ToolCallDelta(index=i, **call)])))
    return out


def _finish_choice(plan: Plan, choice: Choice, finish: FinishEvent) -> Any:
    if plan.kind == "chat":
        return wire.ChatChunkChoice(index=choice.index, delta=wire.ChatDelta(),
                                    finish_reason=chat_finish_reason(plan, finish))
    reason = wire.finish_reason(finish.finish_reason)
    return wire.CompletionChoice(index=choice.index, text="", logprobs=None,
                                 finish_reason=reason)


def _opening(plan: Plan, choice: Choice, first_prompt_text: str | None) -> Any:
    if plan.kind == "chat":
        return wire.ChatChunkChoice(index=choice.index,
                                    delta=wire.ChatDelta(role="assistant", content=""))
    req = plan.request
    if isinstance(req, CompletionRequest) and req.echo:
        text = (choice.prompt_text if choice.prompt_text is not None
                else first_prompt_text or "")
        return wire.CompletionChoice(index=choice.index, text=text, logprobs=None,
                                     finish_reason=None)
    return None


async def _stream(plan: Plan, client: EngineClient, res: _Resources,
                  first: TokenEvent | FinishEvent) -> AsyncIterator[bytes]:
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
            tool_stream = (ToolStream(plan.tools) if plan.kind == "chat" and plan.tools
                           is not None and plan.tools.parses else None)
            while True:
                if pending is None:
                    try:
                        event = await anext(res.events)
                    except StopAsyncIteration:
                        raise OpenAIError("the generation ended without a result",
                                          status=500, code="generation_failed",
                                          type="server_error") from None
                else:
                    event, pending = pending, None
                if isinstance(event, ErrorEvent):
                    yield held + openai_error_frame(openai_error_event(
                        event.code, event.message, event.details))
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
                    await record_monitoring(plan, outcomes[-1])
                    await register_capture(plan, outcomes[-1])
                    await score_probes(plan, outcomes[-1])
                    sense(plan, outcomes[-1])
                    if tool_stream is not None:
                        for piece in _tool_chunks(choice, tool_stream):
                            yield held + _sse(_chunk(plan, [piece]))
                            held = b""
                    yield held + _sse(_chunk(plan, [_finish_choice(plan, choice,
                                                                      outcomes[-1].finish)]))
                    held = b""
                    break
        if wants_millm(plan, outcomes):
            if outcomes:
                await run_analyses(plan, outcomes[0])  # after the tokens, before [DONE]
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
            count_usage(plan, usage_of(plan, outcomes), unfinished=len(under_way),
                        outcomes=outcomes)
        finally:
            res.release()


async def respond(plan: Plan, client: EngineClient, res: _Resources) -> Any:
    """Run the plan: a JSON response, or an SSE response that owns ``res`` from here."""
    if not plan.request.stream:
        # every choice submitted at once: on a batching engine they share forward passes
        # (n > 1, several prompts, extra_messages), on the serial one they queue in order
        results = await asyncio.gather(*(run_choice(client, choice) for choice in plan.choices),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        outcomes = list(results)
        for outcome in outcomes:
            await record_monitoring(plan, outcome)
            await register_capture(plan, outcome)
            await score_probes(plan, outcome)
            sense(plan, outcome)
        if outcomes:
            await run_analyses(plan, outcomes[0])
        body = build_body(plan, outcomes)
        count_usage(plan, usage_of(plan, outcomes), outcomes=outcomes)
        return JsonResponse(body, headers={**plan.headers, **probe_headers(plan, outcomes)})
    # Wait for the first event before answering, so a refusal the engine makes at the
    # start (context length, a detached SAE) is a proper HTTP error, not a frame.
    res.loop = asyncio.get_running_loop()
    res.events = client.agenerate(plan.choices[0].job)
    first = await anext(res.events)
    if isinstance(first, ErrorEvent):
        raise openai_error_event(first.code, first.message, first.details)
    res.later = [_Submitted(client.agenerate(choice.job)) for choice in plan.choices[1:]]
    return SSEResponse(_stream(plan, client, res, first), on_close=res.release,
                       headers=plan.headers)


# threads that wait for the engine's grammar builds (each at most the deadline; the engine
# runs two builds at once, more wait for a free one)
_GRAMMAR_WAITS = ThreadPoolExecutor(8, thread_name_prefix="millm-grammar-wait")


async def build_grammar(client: EngineClient, req: ChatCompletionRequest | CompletionRequest
                        ) -> None:
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
        await asyncio.get_running_loop().run_in_executor(_GRAMMAR_WAITS, client.build_grammar,
                                                         spec)
    except Exception as exc:  # noqa: BLE001 - the engine's refusal, in /v1's shape
        raise openai_error_from_exception(exc) from None


async def serve_generation(*, kind: str, req: ChatCompletionRequest | CompletionRequest,
                           policy: str, lease: str | None = None,
                           ignored: list[str] | None = None, scope: Scope = EVERYONE) -> Any:
    client = runtime().engine
    residency = runtime().residency
    status = await residency.status()
    model, profile = await resolve_model(req.model, status)
    if profile is not None and req.profile is not None and profile != req.profile:
        raise OpenAIError(f"The model name selects profile {profile!r} but the body names "
                          f"{req.profile!r}", status=400, code="invalid_parameter",
                          param="profile")
    if req.allowed_token_ids is not None:
        check_scoring(req)  # scoring mode: refused before anything loads or queues
    if getattr(req, "tools", None) and model.pk is not None \
            and resident_model_id(status) != model.name:
        await off_view_thread(refuse_tools_before_load)(model.pk)
    # before queueing
    residency.check_policy(model, policy=policy, resident=resident_model_id(status),
                           draining=status.draining)
    await build_grammar(client, req)
    permit = await runtime().admission.acquire()
    res = _Resources(permit)
    handed_over = False
    try:
        # a status read before a wait in the queue may be stale: read it again then
        res.use = await residency.acquire(model, policy=policy,
                                          status=None if permit.waited else status,
                                          lease=lease)
        if req.allowed_token_ids is not None:
            arrived()  # a score, not a generation: no batch waits for it
            return await serve_scoring(kind=kind, req=req, model_name=model.name, client=client,
                                       status=res.use.status, ignored=ignored)
        plan = await plan_generation(kind=kind, req=req, model=model,
                                     profile=req.profile or profile, client=client,
                                     attachments=list(res.use.status.attachments),
                                     status=res.use.status, ignored_fields=ignored,
                                     scope=scope)
        response = await respond(plan, client, res)
        handed_over = isinstance(response, SSEResponse)
        return response
    finally:
        if not handed_over:
            res.release()
