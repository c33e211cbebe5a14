"""What a sweep and a calibration share: their prompts read as /v1 reads a request's, their
variants resolved by the steering resolver as /v1 resolves inline steering, the engine
jobs built as /v1 builds them, and the teacher-forced passes with their figures.

- A prompt is a text (run as ``/v1/completions`` runs it) or ``{messages}`` (as
  ``/v1/chat/completions``), read by the /v1 request model with the run's
  ``max_tokens``, ``temperature`` and ``seed``: a point's generation is the job /v1 would
  run for the same request, its steering the variant's at the point's strength
  (``inference.offline_steering``: the /v1 request model, ``steering_args``, the resolver
  with indices checked, a raw vector's missing encoder and the loaded backend's
  capabilities, all before anything runs).
- A variant is one SAE feature (or attached vector, index 0) ``{sae_id?, layer?, index,
  mode?: add|clamp|scale, phase?, window?, condition?}`` whose amount is the strength
  (an add's strength, a clamp's target, a scale's factor), or one inline vector
  ``{sae_id?, vector: {data, layer?, hook?, mode?, min?, max?}}`` whose strength is the
  strength (``sae_id``: at that attachment's hook, where several are attached);
  ``target`` ``{sae_id?, layer?, index}`` names the feature whose activation is read
  (default: the variant's own feature; a vector has none unless named).
- KL(steered ‖ default) is computed from two teacher-forced passes over the prompt and the
  prompt's DEFAULT continuation: the unsteered one (the reference) and the steered one,
  each a one-token job whose finish carries the full next-token log-softmax at the rows
  predicting the continuation (``GenerationJob.distributions_from``), in float64 here.
  In a teacher-forced pass the continuation is part of the prompt, so a control gated to
  a phase is gated to the same rows by a window instead (the rows of generated tokens
  are those from the prompt's length on).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from core.errors import InvalidFeatureIndex, MillmError, ValidationFailed
from gpu_engine.api.fields import prechecked
from gpu_engine.api.protocol import (
    EngineStatus,
    FinishEvent,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringSpec,
)
from inference.errors import OpenAIError
from inference.protocol import ChatCompletionRequest, CompletionRequest

MAX_PROMPTS = 256
MAX_VARIANTS = 64
MAX_STRENGTHS = 64
MAX_TOKENS = 512
MAX_PROMPT_CHARS = 20_000  # a text prompt's characters; a chat's, its messages' JSON
# the reference distributions (a prompt's continuation rows × vocabulary, float32) a run
# holds at once: prompts wait for room before their steered points start
REFERENCE_BYTES = 256 * 2**20

FEATURE_KEYS = frozenset({"sae_id", "layer", "index", "mode", "phase", "window", "condition", "target", "label"})
VECTOR_KEYS = frozenset({"vector", "sae_id", "target", "label"})
TARGET_KEYS = frozenset({"sae_id", "layer", "index"})
SWEPT_MODES = ("add", "clamp", "scale")
VECTOR_LAYOUT = "vector"  # a raw steering vector's attachment (no encoder)
UNSTEERED = SteeringSpec([])


class VariantRefused(MillmError):
    """A variant the steering resolver refused (an SAE not attached, a feature out of
    range, a mode the loaded backend cannot run): the resolver's code, upper-cased, with
    its field named where the experiment's body holds it (``variants[1].index``)."""

    code, status = "INVALID_VARIANT", 400


def refuse(param: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{param}: {message}", details={"param": param, "fields": {param: [message]}})


# --------------------------------------------------------------------------- prompts


@dataclass
class PromptPlan:
    """One prompt as /v1 reads it (``request``), and the jobs of its points."""

    index: int
    request: CompletionRequest | ChatCompletionRequest
    defaults: Any  # inference.protocol.SamplingDefaults of the loaded engine

    def job(self, request_id: str, *, steering: SteeringSpec, monitor: MonitorSpec | None = None) -> GenerationJob:
        """The generation /v1 would run for this prompt with ``steering`` (a choice of n=1)."""
        from inference.policy import template_kwargs

        req = self.request
        sampling = req.sampling(0, self.defaults)
        if isinstance(req, ChatCompletionRequest):
            return GenerationJob(
                request_id=request_id,
                messages=req.conversations()[0],
                sampling=sampling,
                steering=steering,
                monitor=monitor,
                chat_template_kwargs=template_kwargs(req),
                tools=req.template_tools(),
                priority="batch",
            )
        prompt = req.prompt[0]
        args: dict[str, Any] = (
            {"prompt": prompt, "add_special_tokens": req.add_special_tokens}
            if isinstance(prompt, str)
            else {"prompt_token_ids": list(prompt)}
        )
        return GenerationJob(
            request_id=request_id, sampling=sampling, steering=steering, monitor=monitor, priority="batch", **args
        )


def read_prompts(
    prompts: Sequence[Any], *, status: EngineStatus, max_tokens: int, temperature: float, seed: int | None
) -> list[PromptPlan]:
    """Every prompt read by the /v1 request model, refused naming ``prompts[i]`` (or the
    sampling field) before anything runs."""
    from inference.errors import validate_body
    from inference.planning import sampling_defaults

    defaults = sampling_defaults(status)
    base: dict[str, Any] = {"model": status.model_id or "-", "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        base["seed"] = seed
    out = []
    for i, prompt in enumerate(prompts):
        where = f"prompts[{i}]"
        try:
            if isinstance(prompt, str):
                if not prompt:
                    raise refuse(where, "a prompt is not empty")
                if len(prompt) > MAX_PROMPT_CHARS:
                    raise refuse(where, f"at most {MAX_PROMPT_CHARS} characters (got {len(prompt)})")
                req: Any = validate_body(CompletionRequest, {**base, "prompt": prompt})
            elif isinstance(prompt, dict) and set(prompt) == {"messages"}:
                size = len(json.dumps(prompt["messages"], ensure_ascii=False))
                if size > MAX_PROMPT_CHARS:
                    raise refuse(where, f"messages of at most {MAX_PROMPT_CHARS} characters as JSON (got {size})")
                req = validate_body(ChatCompletionRequest, {**base, "messages": prompt["messages"]})
            else:
                raise refuse(where, "a prompt is a text or {messages: [...]}")
        except OpenAIError as exc:
            param = exc.param or ""
            name = param if param in ("max_tokens", "temperature", "seed") else f"{where}.{param}".rstrip(".")
            raise refuse(name, exc.message.removeprefix(f"{param}: ")) from None
        out.append(PromptPlan(i, req, defaults))
    return out


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Target:
    sae_id: str
    layer: int
    index: int


@dataclass
class VariantPlan:
    """One variant resolved at every strength (``specs[k]`` at ``strengths[k]``)."""

    index: int
    body: dict[str, Any]
    specs: list[SteeringSpec]
    target: Target | None
    phase: str = "all"
    window: tuple[int, int | None] | None = None

    @property
    def monitor(self) -> MonitorSpec | None:
        """The target feature read at every row, before and after the layer's steering."""
        t = self.target
        if t is None:
            return None
        return MonitorSpec(
            [
                MonitorEntry(sae_id=t.sae_id, layer=t.layer, features=[t.index], read_point=rp, positions="all")
                for rp in ("pre_steering", "post_steering")
            ]
        )

    def steered(self, position: int, prompt_len: int) -> bool:
        """Whether the variant's steering applies at a row (its phase and window)."""
        if self.phase == "prompt" and position >= prompt_len:
            return False
        if self.phase == "completion" and position < prompt_len:
            return False
        if self.window is not None:
            start, end = self.window
            return position >= start and (end is None or position < end)
        return True


def steering_body(body: dict[str, Any], strength: float) -> dict[str, Any]:
    """The /v1 ``steering`` object of a variant at one strength."""
    if "vector" in body:
        steering = {"features": [], "vectors": [{**body["vector"], "strength": strength}]}
        if body.get("sae_id") is not None:  # which attachment's hook, where several are attached
            steering["sae_id"] = body["sae_id"]
        return steering
    mode = body.get("mode", "add")
    feature: dict[str, Any] = {"index": body["index"], "mode": mode}
    feature["strength" if mode == "add" else "value"] = strength
    for key in ("phase", "window", "condition"):
        if body.get(key) is not None:
            feature[key] = body[key]
    steering: dict[str, Any] = {"features": [feature]}
    for key in ("sae_id", "layer"):
        if body.get(key) is not None:
            steering[key] = body[key]
    return steering


def _variant_param(where: str, param: str | None, vector: bool) -> str:
    """A resolver's field (``steering.features[0].index``) as the variant's
    (``variants[1].index``); a value's range is the strength's (``strengths``)."""
    rest = (param or "").removeprefix("steering")
    for prefix in (".features[0]", ".features", ".vectors[0]", ".vectors"):
        if rest.startswith(prefix):
            rest = rest[len(prefix) :]
            break
    if rest in (".strength", ".value"):
        return "strengths"
    if not rest and not vector:
        rest = ".index"
    return f"{where}{'.vector' if vector and rest not in ('.sae_id', '.layer') else ''}{rest}"


def read_variant(
    i: int, body: Any, *, strengths: Sequence[float], status: EngineStatus, where: str | None = None
) -> VariantPlan:
    """A variant resolved at every strength as /v1 resolves inline steering, and its
    target; refused naming the field before anything runs."""
    from inference.offline_steering import LineSteering, OfflineSteeringError, read, resolve
    from steering.selectors import attachment_pick

    where = where or f"variants[{i}]"
    if not isinstance(body, dict):
        raise refuse(where, "a variant is an object")
    vector = "vector" in body
    allowed = VECTOR_KEYS if vector else FEATURE_KEYS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise refuse(
            f"{where}.{unknown[0]}",
            f"unknown field (a {'vector' if vector else 'feature'} variant takes {', '.join(sorted(allowed))})",
        )
    if vector:
        if not isinstance(body["vector"], dict):
            raise refuse(f"{where}.vector", "an inline vector is {data, layer?, hook?, mode?, min?, max?}")
        for key in ("strength", "value"):
            if key in body["vector"]:
                raise refuse(f"{where}.vector.{key}", "the sweep's strengths set it")
        if body["vector"].get("phase", "all") != "all":
            raise refuse(
                f"{where}.vector.phase",
                "a vector gated to a phase has no teacher-forced equivalent (KL is measured on the "
                "default continuation as part of the prompt); use phase all",
            )
    else:
        if "index" not in body:
            raise refuse(f"{where}.index", "required: the feature steered")
        mode = body.get("mode", "add")
        if mode not in SWEPT_MODES:
            raise refuse(
                f"{where}.mode",
                f"one of {', '.join(SWEPT_MODES)}: the strength is an add's amount, a clamp's target or a "
                "scale's factor (ablate takes none; scale by 0 or add)",
            )
    model = status.model_id or "-"
    specs: list[SteeringSpec] = []
    for strength in strengths:
        asked = LineSteering(i, {"steering": steering_body(body, strength)}, {})
        try:
            req = read(asked, model)
            resolved = resolve(
                asked,
                req,
                attachments=list(status.attachments),
                model=model,
                capabilities=status.capabilities,
                backend=status.backend,
            )
        except OfflineSteeringError as exc:
            error = exc.error
            param = _variant_param(where, error.param, vector)
            message = error.message.removeprefix(f"{error.param}: ") if error.param else error.message
            refusal = VariantRefused(f"{param}: {message}", details={"param": param, "fields": {param: [message]}})
            refusal.code = (error.code or "invalid_variant").upper()  # type: ignore[misc]
            if refusal.code == "INVALID_PARAMETER":
                refusal.code = "VALIDATION_ERROR"  # type: ignore[misc]
                refusal.status = 422  # type: ignore[misc]
            raise refusal from None
        specs.append(resolved.spec if resolved is not None and resolved.spec is not None else UNSTEERED)
    layouts = {(a.sae_id, a.layer): a.layout for a in status.attachments}
    target = _target(where, body, specs, status, layouts, attachment_pick)
    if target is not None:
        caps = status.capabilities
        if caps is not None and not caps.per_request_monitoring:
            raise refuse(f"{where}.target", f"the {status.backend} backend cannot monitor features per request")
    window = body.get("window") if not vector else None
    return VariantPlan(
        index=i,
        body=body,
        specs=specs,
        target=target,
        phase=body.get("phase", "all") if not vector else "all",
        window=(int(window.get("start", 0)), window.get("end")) if isinstance(window, dict) else None,
    )


def _target(
    where: str,
    body: dict[str, Any],
    specs: list[SteeringSpec],
    status: EngineStatus,
    layouts: dict[tuple[str, int], str],
    attachment_pick: Any,
) -> Target | None:
    asked = body.get("target")
    if asked is None:
        if "vector" in body:
            return None
        entry = next((e for s in specs for e in s.entries), None)
        if entry is None or layouts.get(entry.key) == VECTOR_LAYOUT:
            return None  # an attached vector has no encoder: nothing to read
        return Target(entry.sae_id, entry.layer, int(body["index"]))
    if not isinstance(asked, dict) or set(asked) - TARGET_KEYS or "index" not in asked:
        raise refuse(f"{where}.target", "a target is {sae_id?, layer?, index}")
    index = asked["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise refuse(f"{where}.target.index", "an integer feature index")
    try:
        att = attachment_pick(
            attachments=list(status.attachments),
            sae_id=asked.get("sae_id"),
            layer=asked.get("layer"),
            param=f"{where}.target.sae_id",
        )
    except MillmError as exc:
        raise type(exc)(exc.message, details={**exc.details, "param": f"{where}.target.sae_id"}) from None
    if layouts.get((att.sae_id, att.layer)) == VECTOR_LAYOUT:
        raise refuse(f"{where}.target", f"{att.sae_id} is a raw steering vector: it has no feature to read")
    if index < 0 or (att.d_sae is not None and index >= att.d_sae):
        raise InvalidFeatureIndex(
            f"Feature index {index} is out of range for SAE {att.sae_id!r} (d_sae={att.d_sae})",
            details={"param": f"{where}.target.index", "feature_idx": index, "sae_id": att.sae_id, "d_sae": att.d_sae},
        )
    return Target(att.sae_id, att.layer, index)


# --------------------------------------------------------------------------- teacher forcing


def teacher_forced_spec(spec: SteeringSpec, prompt_len: int) -> SteeringSpec:
    """``spec`` as it applies to a generation whose prompt is ``prompt_len`` tokens, for a
    pass whose prompt also holds the continuation: a control gated to a phase is gated to
    the same rows by a window (``prompt``: rows below ``prompt_len``; ``completion``: rows
    from it on), intersected with its own window; one whose rows are then none is dropped."""
    if not any(c.phase != "all" for e in spec.entries for c in e.controls):
        return spec
    entries = []
    with prechecked():
        for entry in spec.entries:
            controls = []
            for c in entry.controls:
                if c.phase == "all":
                    controls.append(c)
                    continue
                lo, hi = (0, prompt_len) if c.phase == "prompt" else (prompt_len, None)
                if c.window is not None:
                    lo = max(lo, c.window.start)
                    hi = c.window.end if hi is None else (hi if c.window.end is None else min(hi, c.window.end))
                if hi is not None and hi <= lo:
                    continue
                controls.append(msgspec.structs.replace(c, phase="all", window=PositionRange(lo, hi)))
            entries.append(msgspec.structs.replace(entry, controls=controls))
    return SteeringSpec(entries)


def teacher_forced_job(
    request_id: str,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    *,
    steering: SteeringSpec,
    distributions: bool,
    logprobs: bool,
) -> GenerationJob:
    """One teacher-forced pass over prompt + continuation (a one-token greedy job): with
    ``distributions``, the full log-softmax at the rows predicting the continuation; with
    ``logprobs``, each prompt token's log-probability."""
    return GenerationJob(
        request_id=request_id,
        prompt_token_ids=[*prompt_ids, *continuation],
        add_special_tokens=False,
        sampling=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=logprobs),
        steering=teacher_forced_spec(steering, len(prompt_ids)),
        distributions_from=len(prompt_ids) if distributions else None,
        priority="batch",
    )


async def unsteered_pass(
    ctx: Any,
    tag: str,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    *,
    distributions: bool,
    logprobs: bool,
) -> FinishEvent:
    """An unsteered ``teacher_forced_job`` on the run's engine (``ctx``, the run's
    ``RunContext``; ``tag`` names the job in its request id): a default's reference
    distributions, or a continuation's log-likelihoods."""
    return await ctx.generate(
        teacher_forced_job(
            ctx.request_id(tag),
            prompt_ids,
            continuation,
            steering=UNSTEERED,
            distributions=distributions,
            logprobs=logprobs,
        )
    )


async def steered_kl(
    ctx: Any,
    tag: str,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    steering: SteeringSpec,
    reference: np.ndarray | None,
) -> list[float] | None:
    """KL(steered ‖ reference) at each position of the default's ``continuation``, from a
    steered teacher-forced pass over it (``ctx``, the run's ``RunContext``; ``tag`` names
    the job); None without a reference (KL not measured)."""
    if reference is None:
        return None
    tf = await ctx.generate(
        teacher_forced_job(
            ctx.request_id(tag), prompt_ids, continuation, steering=steering, distributions=True, logprobs=False
        )
    )
    steered = await ctx.off(distributions_of, tf, len(continuation))
    return await ctx.off(kl_rows, steered, reference)


def distributions_of(finish: FinishEvent, rows: int) -> np.ndarray:
    """The finish's log-softmax rows (float32 ``[rows, vocab]``), checked."""
    from gpu_engine.api.results import unpack_distributions

    if finish.distributions is None:
        raise MillmError("The engine answered a teacher-forced pass without its distributions")
    out = unpack_distributions(finish.distributions)
    if out.shape[0] != rows:
        raise MillmError(f"The engine gave {out.shape[0]} distribution rows for a continuation of {rows} tokens")
    return out


def kl_rows(steered: np.ndarray, reference: np.ndarray) -> list[float]:
    """KL(steered ‖ reference) of each row of two log-softmax arrays, in float64 (each
    row renormalised in float64 first: the engine's rows are float32)."""
    s = steered.astype(np.float64)
    r = reference.astype(np.float64)
    s = s - _logsumexp(s)
    r = r - _logsumexp(r)
    p = np.exp(s)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (s - r), 0.0)
    return [float(v) for v in terms.sum(axis=1)]


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = np.max(x, axis=1, keepdims=True)
    return top + np.log(np.sum(np.exp(x - top), axis=1, keepdims=True))


def loglik_of(finish: FinishEvent, prompt_len: int, length: int) -> list[float] | None:
    """The log-probabilities of the ``length`` tokens after the prompt, from a
    teacher-forced pass's ``prompt_logprobs``."""
    values = finish.prompt_logprobs
    if values is None or len(values) < prompt_len + length:
        return None
    picked = values[prompt_len : prompt_len + length]
    if any(v is None for v in picked):
        return None
    return [float(v) for v in picked]


def mean(values: Sequence[float] | None) -> float | None:
    if not values:
        return None
    total = math.fsum(values) / len(values)
    return total if math.isfinite(total) else None


# --------------------------------------------------------------------------- activations


@dataclass
class TargetReading:
    before: list[dict[str, Any]] = field(default_factory=list)
    after: list[dict[str, Any]] = field(default_factory=list)


def target_reading(finish: FinishEvent, target: Target) -> TargetReading:
    """The target feature's activation at every row the monitors read, before
    (``pre_steering``) and after (``post_steering``) the layer's steering, by position."""
    found: dict[str, dict[int, float]] = {"pre_steering": {}, "post_steering": {}}
    for record in finish.activations:
        if record.sae_id != target.sae_id or record.layer != target.layer or record.read_point not in found:
            continue
        if record.tag:
            continue
        for a in record.features:
            if a.feature_index == target.index:
                found[record.read_point][record.position] = float(a.activation)
    return TargetReading(
        before=[{"position": p, "activation": v} for p, v in sorted(found["pre_steering"].items())],
        after=[{"position": p, "activation": v} for p, v in sorted(found["post_steering"].items())],
    )


def steered_mean(values: list[dict[str, Any]], variant: VariantPlan, prompt_len: int) -> float | None:
    return mean([v["activation"] for v in values if variant.steered(v["position"], prompt_len)])


def finite(values: list[float] | None) -> list[float | None] | None:
    """A list as JSON can hold it (an infinite KL as null)."""
    if values is None:
        return None
    return [v if math.isfinite(v) else None for v in values]
