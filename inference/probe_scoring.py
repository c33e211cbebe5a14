"""Scoring inputs with probes without generating (docs/monitoring.md, "Scoring inputs
with probes"): ``POST /api/probes/score``, its OpenAI-style twin ``POST /v1/probes/score``
and the Batch API's ``/v1/probes/score`` lines all run ``probe_score``.

Each input is one engine job through the path a /v1 generation takes: a
``GenerationJob`` with ``max_tokens: 1``, so the engine runs one forward pass over the
input (the prefill) and decodes nothing further (the one token that pass picks is
dropped). The probes' monitors and capture are the ones a generation arms
(``ProbePlan``), asked for the input's own rows (``prompt``) instead of a completion's, and
the verdicts come from the scorer ``millm.probes`` uses (``outcomes.probe_verdicts``). The
inputs of one request are submitted together, so a batching engine shares forward passes
between them (and with other requests), as it does for ``n > 1``.

Rules:

- never a load: the model is the resident one (``model`` may name it; another model is
  409 ``MODEL_NOT_RESIDENT``, none loaded ``MODEL_NOT_LOADED``), whoever holds a lease;
- /api and /v1 take an admission slot like a /v1 generation (503 ``QUEUE_FULL`` with
  Retry-After); a batch line takes none and runs at batch priority, as its other lines do;
- unsteered, whatever the live steering or the active profile (a probe reads the model
  as it was validated);
- nothing is recorded: no probe history row and no ``probe:verdict`` event (scoring a
  dataset offline is not traffic);
- a malformed request is refused before anything queues or runs: 400
  ``INVALID_PROBE_SCORE_REQUEST`` naming the field, ``UNVALIDATED_PROBE`` for a named
  probe not validated against the resident model.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from core.errors import MillmError, ModelNotLoaded, from_engine_error
from core.metrics import record_tokens
from core.runtime import runtime
from gpu_engine.api.analysis import capture_spec_for
from gpu_engine.api.errors import error_from_dict
from gpu_engine.api.protocol import (
    EngineStatus,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    MonitorSpec,
    SamplingParams,
    TokenEvent,
)
from inference.errors import openai_error_from_validation
from inference.outcomes import Outcome, probe_verdicts
from inference.planning import Choice, capture_limits, off_view_thread, resolve_model
from inference.protocol import ChatMessage, ProbeAsk, _Strict
from inference.routing import routed
from inference.residency import ModelRef, resident_model_id
from monitoring.errors import ProbeNotFound, ProbeScoreRequestInvalid
from monitoring.ownership import EVERYONE, Scope
from monitoring.probe_requests import (
    MAX_REQUEST_PROBES,
    MAX_SCORE_INPUTS,
    ProbePlan,
    probe_request_plan,
)

POLICY = "refuse"  # a score request never loads a model
ROWS = "prompt"  # the rows a scoring pass reads: every row of the input


class ScoreInput(_Strict):
    """One input: a text (tokenised with the model's special tokens, as a completion
    prompt is), a conversation rendered with the chat template, or token ids."""

    text: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    token_ids: list[int] | None = Field(default=None, min_length=1)
    # messages only: end the render with the assistant's header, as a chat request does
    add_generation_prompt: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> ScoreInput:
        given = [k for k in ("text", "messages", "token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"an input gives exactly one of text, messages or token_ids (got {given or 'none'})")
        if self.text is not None and not self.text.strip():
            raise ValueError("text is empty")
        if self.token_ids is not None and any(t < 0 for t in self.token_ids):
            raise ValueError("token ids must be non-negative integers")
        if self.add_generation_prompt and self.messages is None:
            raise ValueError("add_generation_prompt applies to a messages input")
        return self

    def job_args(self) -> dict[str, Any]:
        if self.text is not None:
            return {"prompt": self.text}
        if self.token_ids is not None:
            return {"prompt_token_ids": list(self.token_ids)}
        assert self.messages is not None
        return {
            "messages": [m.for_template() for m in self.messages],
            "add_generation_prompt": self.add_generation_prompt,
        }


class ProbeScoreRequest(_Strict):
    model: str | None = Field(default=None, min_length=1)
    # by id or name, with their own positions or these; omitted: the armed set
    probes: list[str | ProbeAsk] | None = Field(default=None, max_length=MAX_REQUEST_PROBES)
    # a string is short for {"text": ...}
    inputs: list[ScoreInput] = Field(min_length=1, max_length=MAX_SCORE_INPUTS)

    @field_validator("inputs", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"text": v} if isinstance(v, str) else v for v in value]
        return value


def probe_score_parse(data: Any, *, model_required: bool = False) -> ProbeScoreRequest:
    """The request, or 400 ``INVALID_PROBE_SCORE_REQUEST`` naming the first bad field
    (unknown fields included: nothing is ignored)."""
    if not isinstance(data, dict):
        raise ProbeScoreRequestInvalid("the body must be a JSON object", details={"param": None})
    if model_required and not isinstance(data.get("model"), str):
        raise ProbeScoreRequestInvalid("model: a /v1 scoring request names the model", details={"param": "model"})
    try:
        req = ProbeScoreRequest.model_validate(data)
    except ValidationError as exc:
        error = openai_error_from_validation(exc)
        raise ProbeScoreRequestInvalid(error.message, details={"param": error.param}) from None
    except RecursionError:
        raise ProbeScoreRequestInvalid("the body is nested too deeply", details={"param": None}) from None
    if req.probes is not None and not req.probes:
        raise ProbeScoreRequestInvalid(
            "probes is empty: name at least one probe, or omit probes to score with the armed ones",
            details={"param": "probes"},
        )
    return req


def _plan(asked: list[Any] | None, status: EngineStatus, scope: Scope = EVERYONE) -> ProbePlan:
    """The probes scored: those named (each known and validated), else the armed set
    (at least one validated)."""
    try:
        plan = probe_request_plan(asked=asked, status=status, choices=1, scope=scope)
    except ProbeNotFound as exc:
        raise ProbeScoreRequestInvalid(exc.message, details={"param": "probes", **exc.details}) from None
    if plan is None:
        raise ProbeScoreRequestInvalid(
            "no probes named and none armed: name probes, or arm some (POST /api/probes/{id}/arm)",
            details={"param": "probes"},
        )
    if not plan.heads:
        skipped = [{"probe": h.name, "reason": r} for h, r in zip(plan.skipped, plan.reasons)]
        raise ProbeScoreRequestInvalid(
            "no armed probe can be scored on the resident model: "
            + ", ".join(f"{s['probe']} ({s['reason']})" for s in skipped),
            details={"param": "probes", "skipped": skipped},
        )
    return plan


async def _model(name: str | None, status: EngineStatus) -> ModelRef:
    resident = resident_model_id(status)
    if name is None:
        if resident is None:
            raise ModelNotLoaded(
                "No model is loaded; probe scoring runs on the resident model and never loads one",
                details={"param": "model"},
            )
        return ModelRef(None, resident, "loaded")
    model, profile = await resolve_model(name, status)
    if profile is not None:
        raise ProbeScoreRequestInvalid(
            f"model {name!r} selects profile {profile!r}: probe scoring is never steered", details={"param": "model"}
        )
    runtime().residency.check_policy(model, policy=POLICY, resident=resident, draining=status.draining)
    return model


def _jobs(req: ProbeScoreRequest, plan: ProbePlan, model: str, priority: str) -> list[GenerationJob]:
    entries = plan.monitor_entries(ROWS)
    need = plan.capture_need(ROWS)
    capture = capture_spec_for(need, None, **capture_limits(model)) if need else None
    return [
        GenerationJob(
            request_id=f"prbscore-{uuid.uuid4().hex}",
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            monitor=MonitorSpec(entries) if entries else None,
            capture=capture,
            priority=priority,
            **item.job_args(),
        )
        for item in req.inputs
    ]


async def _run(choice: Choice) -> Outcome:
    """One input's pass; an engine refusal as its domain error (both surfaces map it)."""
    tokens: list[TokenEvent] = []
    async for event in runtime().engine.agenerate(choice.job):
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, FinishEvent):
            return Outcome(choice, event, tokens)
        elif isinstance(event, ErrorEvent):
            raise from_engine_error(
                error_from_dict({"code": event.code, "message": event.message, "details": event.details})
            )
    raise MillmError("the scoring pass ended without a result")


async def probe_score(
    req: ProbeScoreRequest, *, priority: str = "interactive", admit: bool = True, scope: Scope = EVERYONE
) -> tuple[dict[str, Any], dict[str, str]]:
    """Score every input with the probes (module docstring): the answer's body (the
    /api envelope's ``data``, /v1's whole body) and its headers. ``admit``: take an
    admission slot (the interactive routes); a batch line does not. With several engines, on
    the engine of the model it names (none named: the default engine's)."""
    async with routed(req.model):
        return await _probe_score(req, priority=priority, admit=admit, scope=scope)


async def _probe_score(
    req: ProbeScoreRequest, *, priority: str, admit: bool, scope: Scope
) -> tuple[dict[str, Any], dict[str, str]]:
    runtime_ = runtime()
    residency = runtime_.residency
    status = await residency.status()
    model = await _model(req.model, status)
    plan = await off_view_thread(_plan)(req.probes, status, scope)  # refusals before the queue
    permit = await runtime_.admission.acquire() if admit else None
    try:
        # a status read before a wait in the queue may be stale: read it again then
        use = await residency.acquire(
            model, policy=POLICY, status=None if permit is not None and permit.waited else status
        )
        if use.status.model_id != status.model_id:  # swapped while this request queued
            plan = await off_view_thread(_plan)(req.probes, use.status, scope)
        choices = [Choice(i, job) for i, job in enumerate(_jobs(req, plan, model.name, priority))]
        results = await asyncio.gather(*(_run(c) for c in choices), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        outcomes: list[Outcome] = list(results)  # type: ignore[arg-type]
        scored = [await probe_verdicts(plan, o, rows=ROWS) for o in outcomes]
    finally:
        if permit is not None:
            permit.release()
    prompt_tokens = sum(o.finish.usage.prompt_tokens for o in outcomes)
    record_tokens(model=model.name, completion_tokens=0, prompt_tokens=prompt_tokens)
    data = [
        {
            "index": o.choice.index,
            "prompt_tokens": o.finish.usage.prompt_tokens,
            "probes": [{k: v for k, v in verdict.items() if k != "choice"} for verdict in verdicts],
        }
        for o, verdicts in zip(outcomes, scored)
    ]
    body = {
        "object": "probe_score",
        "model": model.name,
        "data": data,
        "forward_passes": sum(o.finish.forward_passes for o in outcomes),
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return body, {"X-miLLM-Backend": runtime_.engine.backend_name, "X-miLLM-Steering": "none"}


__all__ = ["ProbeScoreRequest", "probe_score", "probe_score_parse"]
