"""Preparing a request for the loaded model: its token ids checked or encoded, its token
budget against the context window, and the per-request hooks its steering and
monitoring need. Functions of what they read (the backend, the attachment table); the
engine calls them on its worker thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..api import jobs
from ..api.errors import ContextLengthExceeded, InvalidParameter
from ..api.protocol import GenerationJob
from ..interp.plans import ENCODER_MODES, refuse_encoder_controls, request_hooks, with_capture


def validate_ids(backend: Any, ids: Sequence[int], param: str) -> list[int]:
    vocab = backend.vocab_size
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidParameter(
                f"token id {t!r} is outside the vocabulary (0..{vocab - 1})",
                param=param,
                details={"token_id": t, "vocab_size": vocab},
            )
    return list(ids)


def check_capabilities(backend: Any, job: GenerationJob) -> None:
    """Refuse, before anything runs, a request asking for what the loaded backend reports
    it cannot do (``capabilities()``): never ignore it."""
    caps = backend.capabilities()
    # (the capability's name, whether the backend has it, the parameter that needs it)
    needs: list[tuple[str, bool, str]] = []
    if job.steering is not None and not job.steering.is_empty():
        needs.append(("per_request_steering", caps.per_request_steering, "steering"))
    if job.steering is not None and job.steering.has_controls():
        # feature controls, or only inline vectors gated to a phase or clamping
        controls = any(e.controls for e in job.steering.entries)
        clamps = any(v.projects for e in job.steering.entries for v in e.vectors)
        param = (
            "steering.features.mode" if controls else "steering.vectors.mode" if clamps else "steering.vectors.phase"
        )
        needs.append(("steering_controls", caps.steering_controls, param))
    if job.steering is not None and any(e.splice is not None for e in job.steering.entries):
        # a key some backends report only (UNSET, falsy: it does not say it can)
        needs.append(("splice", bool(caps.splice), "steering.splice"))
    if job.monitor is not None and job.monitor.entries:
        needs.append(("per_request_monitoring", caps.per_request_monitoring, "monitor"))
    if job.sampling.logprobs or job.sampling.top_logprobs:
        needs.append(("logprobs", caps.logprobs, "logprobs"))
    if job.sampling.prompt_logprobs:
        needs.append(("prompt_logprobs", caps.prompt_logprobs, "prompt_logprobs"))
    if job.distributions_from is not None:
        # a key some backends report only (UNSET, falsy: it does not say it can)
        needs.append(("prompt_distributions", bool(caps.prompt_distributions), "distributions_from"))
    if job.capture is not None:
        needs.append(("hidden_state_capture", caps.hidden_state_capture, "capture"))
        if job.capture.attention is not None:
            needs.append(("attention_capture", caps.attention_capture, "capture.attention"))
    if job.sampling.structured is not None:
        needs.append(("structured_output", caps.structured_output, "response_format"))
    if job.tools:
        needs.append(("tool_calling", caps.tool_calling, "tools"))
    for capability, has, param in needs:
        if not has:
            # a backend may say why (``Capabilities.<capability>_reason``)
            reason = getattr(caps, f"{capability}_reason", None) or None
            details = {"backend": backend.name, "capability": capability}
            if reason:
                details["reason"] = reason
            raise InvalidParameter(
                f"the {backend.name} backend cannot honour {param} ({capability} is off"
                + (f": {reason})" if reason else ")"),
                param=param,
                details=details,
            )


def prompt_ids(backend: Any, job: GenerationJob) -> list[int]:
    """The job's prompt as checked token ids (given, rendered from ``messages`` or encoded
    from text), its ``distributions_from`` checked against their number."""
    if job.prompt_token_ids is not None:
        ids = validate_ids(backend, job.prompt_token_ids, "prompt")
    elif job.messages is not None:
        kwargs = dict(job.chat_template_kwargs)
        if job.tools:
            kwargs["tools"] = job.tools
        ids = backend.encode_messages(job.messages, add_generation_prompt=job.add_generation_prompt, **kwargs)
    else:
        ids = backend.encode_text(job.prompt or "", add_special_tokens=job.add_special_tokens)
    if not ids:
        raise InvalidParameter("the prompt is empty after tokenisation", param="prompt")
    start = job.distributions_from
    if start is not None and start >= len(ids):
        raise InvalidParameter(
            f"distributions_from {start} must be below the prompt's length ({len(ids)} tokens): "
            "row r predicts prompt token distributions_from + r",
            param="distributions_from",
            details={"distributions_from": start, "prompt_tokens": len(ids)},
        )
    if start is not None and (len(ids) - start) * backend.vocab_size * 4 > jobs.MAX_DISTRIBUTION_BYTES:
        rows = len(ids) - start
        raise InvalidParameter(
            f"distributions_from {start} asks for {rows} rows of {backend.vocab_size} log-probabilities, "
            f"more than {jobs.MAX_DISTRIBUTION_BYTES} bytes: start later in the prompt",
            param="distributions_from",
            details={"rows": rows, "vocab_size": backend.vocab_size, "max_bytes": jobs.MAX_DISTRIBUTION_BYTES},
        )
    return ids


def token_budget(backend: Any, job: GenerationJob, n_prompt: int) -> int:
    """The generation's max_tokens (the rest of the context window when not asked)."""
    window = backend.context_length
    asked = job.sampling.max_tokens
    room = max(window - n_prompt, 0)
    default = job.sampling.max_tokens_default
    max_tokens = asked if asked is not None else (room if default is None else min(default, room))
    if n_prompt + max(max_tokens, 1) > window:
        raise ContextLengthExceeded(prompt_tokens=n_prompt, max_tokens=max_tokens, context_length=window)
    return max_tokens


def encode_inputs(backend: Any, items: Sequence[Any], param: str, add_special_tokens: bool = True) -> list[list[int]]:
    """Embedding or scoring inputs (texts or token-id lists) as checked token ids."""
    out = []
    for item in items:
        if isinstance(item, str):
            ids = backend.encode_text(item, add_special_tokens=add_special_tokens)
        elif isinstance(item, (list, tuple)):
            ids = validate_ids(backend, list(item), param)
        else:
            raise InvalidParameter("each input must be a string or a list of token ids", param=param)
        if not ids:
            raise InvalidParameter("an input is empty", param=param)
        if len(ids) > backend.context_length:
            raise ContextLengthExceeded(prompt_tokens=len(ids), max_tokens=0, context_length=backend.context_length)
        out.append(ids)
    return out


__all__ = [
    "ENCODER_MODES",
    "check_capabilities",
    "encode_inputs",
    "prompt_ids",
    "refuse_encoder_controls",
    "request_hooks",
    "token_budget",
    "validate_ids",
    "with_capture",
]
