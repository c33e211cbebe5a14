"""Preparing a request for the loaded model: its token ids checked or encoded, its token
budget against the context window, and the per-request hooks its steering and
monitoring need. Functions of what they read (the backend, the attachment table); the
engine calls them on its worker thread."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .attachments import Attachment
from .interp.controls import ControlTable, control_range
from .errors import ContextLengthExceeded, InvalidParameter, SAENotAttached
from .interp.hooks import AttachmentPlan, MonitorPlan, RequestHooks
from .protocol import AttachmentKey, GenerationJob, SteeringEntry


def validate_ids(backend: Any, ids: Sequence[int], param: str) -> list[int]:
    vocab = backend.vocab_size
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidParameter(f"token id {t!r} is outside the vocabulary (0..{vocab - 1})", param=param,
                                   details={"token_id": t, "vocab_size": vocab})
    return list(ids)


def check_capabilities(backend: Any, job: GenerationJob) -> None:
    """Refuse, before anything runs, a request asking for what the loaded backend reports
    it cannot do (``capabilities()``): never ignore it."""
    caps = backend.capabilities()
    needs = []
    if job.steering is not None and not job.steering.is_empty():
        needs.append(("per_request_steering", "steering"))
    if job.steering is not None and job.steering.has_controls():
        needs.append(("steering_controls", "steering.features.mode"))
    if job.monitor is not None and job.monitor.entries:
        needs.append(("per_request_monitoring", "monitor"))
    if job.sampling.logprobs or job.sampling.top_logprobs:
        needs.append(("logprobs", "logprobs"))
    if job.sampling.prompt_logprobs:
        needs.append(("prompt_logprobs", "prompt_logprobs"))
    if job.capture is not None:
        needs.append(("hidden_state_capture", "capture"))
        if job.capture.attention is not None:
            needs.append(("attention_capture", "capture.attention"))
    if job.sampling.structured is not None:
        needs.append(("structured_output", "response_format"))
    if job.tools:
        needs.append(("tool_calling", "tools"))
    for capability, param in needs:
        if not caps.get(capability, False):
            raise InvalidParameter(f"the {backend.name} backend cannot honour {param} ({capability} is off)",
                                   param=param, details={"backend": backend.name, "capability": capability})


def prompt_ids(backend: Any, job: GenerationJob) -> list[int]:
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


# what reads a feature's activation, and so needs an encoder
ENCODER_MODES = ("clamp", "scale")


def refuse_encoder_controls(entry: SteeringEntry) -> None:
    """A raw steering vector has decoder rows only: add and ablate work on it; clamp,
    scale and conditions (which read an activation) are refused, naming the field."""
    for c in entry.controls:
        if c.mode in ENCODER_MODES:
            raise InvalidParameter(f"{entry.sae_id!r} is a raw steering vector: mode {c.mode!r} reads a "
                                   "feature's activation, which a vector has no encoder for (use add or ablate)",
                                   param="steering.features.mode",
                                   details={"sae_id": entry.sae_id, "index": c.index, "mode": c.mode})
        if c.condition is not None:
            raise InvalidParameter(f"{entry.sae_id!r} is a raw steering vector: a condition reads its "
                                   "trigger's activation, which a vector has no encoder for",
                                   param="steering.features.condition",
                                   details={"sae_id": entry.sae_id, "index": c.index})


def request_hooks(backend: Any, attachments: Mapping[AttachmentKey, Attachment], job: GenerationJob,
                  n_prompt: int) -> RequestHooks | None:
    plans: dict[AttachmentKey, AttachmentPlan] = {}

    def attachment(key: AttachmentKey) -> Attachment:
        att = attachments.get(key)
        if att is None:
            raise SAENotAttached(f"SAE {key[0]!r} is not attached at layer {key[1]}",
                                 details={"sae_id": key[0], "layer": key[1]})
        return att

    for entry in job.steering.entries if job.steering else []:
        if entry.is_empty():
            continue
        att = attachment(entry.key)
        att.sae.check_indices(entry.sae_id, entry.indices())
        if not att.sae.has_encoder:
            refuse_encoder_controls(entry)
        plan = plans.setdefault(entry.key, AttachmentPlan(entry.key))
        if entry.features:
            plan.delta = att.sae.steering_delta(entry.features, dtype=backend.dtype,
                                                device=getattr(backend, "sae_device", backend.device))
        controls = [c for c in entry.controls if not c.no_op]
        for c in controls:
            start, end = control_range(c, n_prompt)
            if c.window is not None and c.window.start >= backend.context_length:
                raise InvalidParameter(
                    f"steering window starts at {c.window.start}, past the context window "
                    f"({backend.context_length} positions)", param="steering.features.window",
                    details={"index": c.index, "context_length": backend.context_length})
            if start >= min(end, backend.context_length):
                raise InvalidParameter(
                    f"feature {c.index}'s phase {c.phase!r} and window select no position of this "
                    f"request (prompt of {n_prompt} tokens)", param="steering.features.window",
                    details={"index": c.index, "prompt_tokens": n_prompt})
        if controls:
            plan.controls = ControlTable.build(controls, att.sae, prompt_len=n_prompt)
            plan.cols = (0, plan.controls.size)
    for mon in job.monitor.entries if job.monitor else []:
        att = attachment(mon.key)
        if not att.sae.has_encoder:
            raise InvalidParameter(f"{mon.sae_id!r} is a raw steering vector: it has no encoder, so nothing "
                                   "can be monitored with it", param="monitor.sae_id",
                                   details={"sae_id": mon.sae_id, "layer": mon.layer})
        att.sae.check_indices(mon.sae_id, mon.features)
        plan = plans.setdefault(mon.key, AttachmentPlan(mon.key))
        mp = MonitorPlan(mon, att.sae, prompt_len=n_prompt)
        (plan.pre if mon.read_point == "pre_steering" else plan.post).append(mp)
    return RequestHooks(job.request_id, plans) if plans else None


def with_capture(backend: Any, job: GenerationJob, hooks: RequestHooks | None, n_prompt: int,
                 max_tokens: int) -> RequestHooks | None:
    """Add the request's capture plan (its buffer allocated now) to its hooks, after
    checking its layers and its worst-case size (``capture_too_large``): before any
    forward runs."""
    spec = job.capture
    if spec is None:
        return hooks
    n_layers = backend.num_layers
    bad = [layer for layer in spec.layers if layer >= n_layers]
    if bad:
        raise InvalidParameter(f"capture.layers {bad} out of range: the model has layers 0..{n_layers - 1}",
                               param="capture.layers", details={"layers": bad, "num_layers": n_layers})
    from .interp.capture import CapturePlan, estimate_bytes
    from .errors import CaptureTooLarge

    geometry = scaling = None
    att = spec.attention
    if att is not None:
        geometry = backend.attention_geometry
        bad = [layer for layer in att.layers if layer >= n_layers]
        if bad:
            raise InvalidParameter(f"capture.attention.layers {bad} out of range: the model has layers "
                                   f"0..{n_layers - 1}", param="capture.attention.layers",
                                   details={"layers": bad, "num_layers": n_layers})
        bad = [h for h in att.heads or () if h >= geometry.num_heads]
        if bad:
            raise InvalidParameter(f"capture.attention.heads {bad} out of range: the model has heads "
                                   f"0..{geometry.num_heads - 1}", param="capture.attention.heads",
                                   details={"heads": bad, "num_heads": geometry.num_heads})
        scaling = {layer: backend.attention_scaling(layer) for layer in att.layers}
    dtype = backend.dtype
    estimate, rows = estimate_bytes(spec, prompt_len=n_prompt, max_tokens=max_tokens,
                                    hidden_size=backend.hidden_size, itemsize=dtype.itemsize, geometry=geometry)
    if spec.max_bytes and estimate > spec.max_bytes:
        raise CaptureTooLarge(estimate_bytes=estimate, max_bytes=spec.max_bytes, rows=rows,
                              layers=len(set(spec.layers) | set(att.layers if att is not None else ())))
    if (spec.store_max_bytes is not None and spec.directory is not None
            and estimate > spec.inline_max_bytes and estimate > spec.store_max_bytes):
        from .errors import CaptureStoreFull

        raise CaptureStoreFull(estimate_bytes=estimate, room_bytes=max(0, spec.store_max_bytes))
    steered = job.steering is not None and not job.steering.is_empty()
    model = spec.model or getattr(getattr(backend, "job", None), "model_id", "") or ""
    # a backend whose workers take the rows (vLLM) gets a plan that only packs their parts
    device = None if getattr(backend, "captures_in_workers", False) else backend.device
    plan = CapturePlan(spec, request_id=job.request_id, prompt_len=n_prompt, max_tokens=max_tokens,
                       hidden_size=backend.hidden_size, dtype=dtype, device=device, model=model,
                       backend=backend.name, steering_hash=job.steering.canonical_hash() if steered else None,
                       geometry=geometry, scaling=scaling)
    hooks = hooks if hooks is not None else RequestHooks(job.request_id)
    hooks.capture = plan
    return hooks


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


__all__ = ["ENCODER_MODES", "check_capabilities", "encode_inputs", "prompt_ids", "refuse_encoder_controls",
           "request_hooks", "token_budget", "validate_ids", "with_capture"]
