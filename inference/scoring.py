"""Scoring mode on /v1 (the original's, with vLLM's field names): ``allowed_token_ids``
turns a chat or completions request into one forward pass that reads the next token's
distribution over those ids, normalised over that set only; nothing is generated.

Rules (docs/api-v1.md, "Scoring mode"):

- ``max_tokens`` (or ``max_completion_tokens``) must be 1 and ``n`` 1; ``stream``,
  ``echo``, ``stop``, penalties, ``logit_bias``, ``seed`` and the steering, monitoring and
  capture extensions are refused (400 ``invalid_parameter`` naming the field): a scoring
  pass is never steered or monitored, and a field it cannot honour is never ignored;
- ``temperature`` divides the logits before normalising (0 or absent: no scaling);
  ``top_p`` does not apply either and is refused when it would change something;
- the answer's text is the most probable allowed token; ``logprobs`` (completions: an
  int, chat: ``true``) returns every allowed token's log-probability, keyed by its text or,
  with ``return_tokens_as_token_ids``, by ``token_id:<id>``; without it ``logprobs`` is null;
- a token id outside the vocabulary, an empty prompt: 400; a non-finite logit among the
  allowed ids: 500 ``non_finite_logits``; a backend that cannot score refuses.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

from django.http import JsonResponse

from core.engine_client import EngineClient
from core.version import version
from gpu_engine.api.protocol import ScoreJob, ScoreResult
from inference import wire
from inference.errors import OpenAIError
from inference.policy import ignored_headers, template_kwargs
from inference.protocol import ChatCompletionRequest, CompletionRequest

ENGINE_CALL_TIMEOUT_S = 120


def _refuse(param: str, message: str) -> OpenAIError:
    return OpenAIError(message, status=400, code="invalid_parameter", param=param)


def check_scoring(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse, before anything loads or runs, what scoring mode cannot honour."""
    max_tokens = getattr(req, "effective_max_tokens", req.max_tokens)
    if max_tokens != 1:
        raise _refuse("max_tokens", "scoring mode (allowed_token_ids) needs max_tokens: 1")
    if req.n != 1:
        raise _refuse("n", "scoring mode (allowed_token_ids) needs n: 1")
    unsupported = {
        "stream": req.stream,
        "stop": bool(req.stop),
        "seed": req.seed is not None,
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "repetition_penalty": req.repetition_penalty not in (None, 1.0),
        "logit_bias": bool(req.logit_bias),
        "top_k": req.top_k not in (None, -1, 0),
        "top_p": req.top_p not in (None, 1.0),
        "profile": req.profile is not None,
        "steering": req.steering is not None and bool(req.steering.features or req.steering.vectors),
        "steering_intensity": req.steering_intensity is not None,
        "return_sae_activations": req.return_sae_activations is not None,
        "monitoring": getattr(req, "monitoring", None) is not None,
        "capture": req.capture is not None,
        "analyze": getattr(req, "analyze", None) is not None,
        "probes": bool(getattr(req, "probes", None)),
        "tools": bool(getattr(req, "tools", None)),
        "response_format": (getattr(req, "response_format", None) or {}).get("type", "text") != "text",
        "echo": bool(getattr(req, "echo", False)),
        "extra_messages": bool(getattr(req, "extra_messages", None)),
    }
    for field, present in unsupported.items():
        if present:
            raise _refuse(
                field,
                f"{field} does not apply in scoring mode (allowed_token_ids): "
                "one unsteered, unmonitored forward pass reads the next token",
            )


def _jobs(req: ChatCompletionRequest | CompletionRequest) -> list[ScoreJob]:
    ids = list(req.allowed_token_ids or [])
    if isinstance(req, ChatCompletionRequest):
        return [
            ScoreJob(
                request_id=f"score-{uuid.uuid4().hex}",
                messages=req.template_messages(),
                allowed_token_ids=ids,
                chat_template_kwargs=template_kwargs(req),
            )
        ]
    jobs = []
    for prompt in req.prompt:
        if isinstance(prompt, str):
            jobs.append(
                ScoreJob(
                    request_id=f"score-{uuid.uuid4().hex}",
                    prompt=prompt,
                    allowed_token_ids=ids,
                    add_special_tokens=req.add_special_tokens,
                )
            )
        else:
            jobs.append(
                ScoreJob(
                    request_id=f"score-{uuid.uuid4().hex}",
                    prompt_token_ids=list(prompt),
                    allowed_token_ids=ids,
                )
            )
    return jobs


def renormalised(result: ScoreResult, temperature: float | None) -> list[tuple[int, str, float]]:
    """``(id, text, logprob)`` of every allowed token, normalised over the allowed set
    after dividing by the temperature, most probable first. The engine's values are
    log-softmax over the whole vocabulary; a shared constant cancels in the
    normalisation, so ``(l_i - c) / T`` normalises exactly as ``l_i / T`` does."""
    t = temperature if temperature else 1.0
    values = [(e.token_id, e.token, e.logprob) for e in result.allowed]
    for token_id, _, lp in values:
        if not math.isfinite(lp):
            raise OpenAIError(
                f"the model's logit for allowed token {token_id} is not finite ({lp})",
                status=500,
                code="non_finite_logits",
                param="allowed_token_ids",
            )
    scaled = [lp / t for _, _, lp in values]
    top = max(scaled)
    lse = top + math.log(sum(math.exp(v - top) for v in scaled))
    out = [(token_id, text, v - lse) for (token_id, text, _), v in zip(values, scaled)]
    return sorted(out, key=lambda e: -e[2])


def _key(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


async def serve_scoring(
    *,
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    model_name: str,
    client: EngineClient,
    status: Any,
    ignored: list[str] | None,
) -> JsonResponse:
    check_scoring(req)
    results = [await asyncio.to_thread(client.score, job, timeout_s=ENGINE_CALL_TIMEOUT_S) for job in _jobs(req)]
    as_ids = req.return_tokens_as_token_ids
    common = {
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": wire.fingerprint(status, version()),
    }
    prompt_tokens = sum(r.prompt_tokens for r in results)
    usage = wire.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=len(results),
        total_tokens=prompt_tokens + len(results),
    )
    headers = {
        "X-miLLM-Backend": str(getattr(status, "backend", "") or ""),
        "X-miLLM-Steering": "none",
        "X-miLLM-Scoring": f"allowed={len(req.allowed_token_ids or [])}",
        **ignored_headers(ignored or []),
    }
    if kind == "chat":
        (result,) = results
        ranked = renormalised(result, req.temperature)
        best_id, best_text, best_lp = ranked[0]
        logprobs = None
        if getattr(req, "logprobs", False):
            entry = wire.ChatTokenLogprob(
                token=_key(best_id, best_text, as_ids),
                logprob=best_lp,
                bytes=list(best_text.encode()),
                top_logprobs=[
                    wire.TopLogprob(token=_key(i, t, as_ids), logprob=lp, bytes=list(t.encode())) for i, t, lp in ranked
                ],
            )
            logprobs = wire.ChatLogprobs(content=[entry])
        body = wire.ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            **common,
            usage=usage,
            choices=[
                wire.ChatChoice(
                    index=0,
                    message=wire.ChatMessage(content=best_text),
                    logprobs=logprobs,
                    finish_reason="length",
                )
            ],
        ).dump()
        return JsonResponse(body, headers=headers)
    assert isinstance(req, CompletionRequest)
    choices = []
    for index, (prompt, result) in enumerate(zip(req.prompt, results)):
        ranked = renormalised(result, req.temperature)
        best_id, best_text, best_lp = ranked[0]
        logprobs = None
        if req.logprobs is not None:
            offset = len(prompt) if isinstance(prompt, str) else 0
            logprobs = wire.CompletionLogprobs(
                tokens=[_key(best_id, best_text, as_ids)],
                token_logprobs=[best_lp],
                top_logprobs=[{_key(i, t, as_ids): lp for i, t, lp in ranked}],
                text_offset=[offset],
            )
        choices.append(wire.CompletionChoice(index=index, text=best_text, logprobs=logprobs, finish_reason="length"))
    body = wire.Completion(id=f"cmpl-{uuid.uuid4().hex}", **common, usage=usage, choices=choices).dump()
    return JsonResponse(body, headers=headers)


__all__ = ["check_scoring", "renormalised", "serve_scoring"]
