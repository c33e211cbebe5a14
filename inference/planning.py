"""Planning one /v1 generation request: which registry row it names, the steering and
monitoring it resolves to, and the engine jobs of its choices — everything decided before
the first token (``Plan``).

``inference.serving`` runs the plan (admission, residency, the engine jobs, the JSON body
or SSE stream); this module reads the database only through ``off_view_thread`` (or not at
all, when this process's copies of the live steering and the monitoring configuration are
fresh).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from core.engine_client import EngineClient
from core.runtime import runtime
from core.version import version
from gpu_engine.api.analysis import CaptureNeed, capture_spec_for
from gpu_engine.api.steering import SteeringVector
from gpu_engine.api.protocol import (
    AttachmentStatus,
    AttentionCaptureSpec,
    CaptureSpec,
    EngineStatus,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
)
from inference import selectors, wire
from inference.activations import monitor_resolve
from inference.errors import OpenAIError
from inference.fidelity import FidelityPlan, fidelity_plan
from inference.policy import ignored_headers, template_kwargs
from inference.protocol import (
    OPENAI_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingDefaults,
)
from inference.protocol_extensions import InlineVector
from inference.residency import ModelRef
from inference.tools import ToolPlan, tool_plan
from monitoring.analysis import PreparedAnalysis, analysis_check_backend
from monitoring.ownership import EVERYONE, Scope
from monitoring.probe_requests import ProbePlan, probe_request_plan
from monitoring.probes import armed_copy
from monitoring.sensing import SensingPlan, sensing_request_plan, watch_copy
from monitoring.services import (
    capture_room,
    monitoring_merge,
    monitoring_request_config,
    monitoring_request_entry,
)
from steering.live import LiveScopes, key_scope, live_copy
from steering.inline_vectors import VectorAsk
from steering.services import ResolvedSteering, steering_resolve_request


@dataclass
class Choice:
    index: int
    job: GenerationJob
    prompt_text: str | None = None  # completions: the prompt as text (for echo)
    # completions' max_tokens 0: the one token the engine generates is not answered
    # (``inference.outcomes.prompt_only``)
    prompt_only: bool = False


@dataclass
class Plan:
    """Everything decided before the first token."""

    kind: str  # "chat" | "completion"
    request: ChatCompletionRequest | CompletionRequest
    model: ModelRef
    steering: ResolvedSteering
    monitor: MonitorSpec | None
    attachment: AttachmentStatus | None
    choices: list[Choice]
    backend: str
    monitoring: MonitorEntry | None = None  # /api/monitoring's entry, recorded apart
    analyses: list[PreparedAnalysis] = field(default_factory=list)  # analyze, prepared
    probes: ProbePlan | None = None  # the probes scored (``probes`` or the armed set)
    sensing: SensingPlan | None = None  # the watched clusters and circuits (observe only)
    fidelity: FidelityPlan | None = None  # monitoring.fidelity: the attachments measured
    ignored_fields: list[str] = field(default_factory=list)  # sent, read by nothing
    fingerprint: str = ""  # system_fingerprint (wire.fingerprint)
    tools: ToolPlan | None = None  # chat tools on the loaded model (inference.tools)
    response_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # the id its records (monitoring history, captures, probe verdicts, sensing) are kept
    # under: the answer's own id (``object_id``) unless the route answers under another
    # (/v1/responses: its ``resp_…`` id)
    record_id: str | None = None
    scope: Scope = EVERYONE  # whose request: its captures and history are the owner's
    quota: Any = None  # the key's quota ticket (inference.quotas), charged the real tokens
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.response_id

    @property
    def history_id(self) -> str:
        return self.record_id or self.object_id

    @property
    def headers(self) -> dict[str, str]:
        return {
            "X-miLLM-Backend": self.backend,
            "X-miLLM-Steering": self.steering.header_value,
            **self.seed_header,
            **self.batch_header,
            **ignored_headers(self.ignored_fields),
        }

    @property
    def batch_header(self) -> dict[str, str]:
        """``X-miLLM-Batch`` when a chat request brought ``extra_messages``: how many
        conversations and choices ran together."""
        extra = getattr(self.request, "extra_messages", None)
        if not extra:
            return {}
        return {"X-miLLM-Batch": f"conversations={1 + len(extra)};choices={len(self.choices)}"}

    @property
    def seed_header(self) -> dict[str, str]:
        """``X-miLLM-Seed`` when the request sent a seed: ``<seed>;scope=request`` (each
        choice draws from its own generator, seeded by the request alone, so neighbours
        in a batch change nothing), with ``;choices=<n>`` when choice *i* used seed + i."""
        seed = self.request.seed
        if seed is None:
            return {}
        n = self.request.n
        return {"X-miLLM-Seed": f"{seed};scope=request" + (f";choices={n}" if n > 1 else "")}

    @property
    def wants_millm(self) -> bool:
        return self.request.uses_extensions or self.probes is not None


def off_view_thread(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (database work) on a pool thread rather than the one thread that runs sync
    views: a slow view (an attach draining the generations) must not hold up planning,
    nor the monitoring write a generation makes as it finishes. The thread's connection
    is checked as a request's would be."""

    def run(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        return fn(*args, **kwargs)

    return sync_to_async(run, thread_sensitive=False)


def vector_asks(vectors: list[InlineVector], params: tuple[tuple[str, str], ...]) -> list[VectorAsk]:
    """A request's inline vectors as the resolver places them; ``params``: the body
    locations another tool's shape sent them at (miLLM's own: ``steering.vectors[i]``)."""
    asks = []
    for i, v in enumerate(vectors):
        layer_param, data_param = (
            params[i] if i < len(params) else (f"steering.vectors[{i}].layer", f"steering.vectors[{i}].data")
        )
        vector = SteeringVector(v.data.raw, v.data.dtype, v.strength, v.phase, v.mode, v.min, v.max)
        asks.append(VectorAsk(vector, v.data.width, v.layer, v.hook, layer_param, data_param))
    return asks


def steering_args(req: ChatCompletionRequest | CompletionRequest, profile: str | None) -> dict[str, Any]:
    """A request's ``steering``, ``profile`` and ``steering_intensity`` as
    ``steering_resolve_request`` takes them (here and in ``manage.py capture``)."""
    inline = req.steering
    alias = req.steering_alias  # another tool's shape: its errors name its fields
    return {
        "inline_sae_id": inline.sae_id if inline is not None else None,
        # each feature as the engine's FeatureControl, its ranges checked by the body's model
        "inline_features": ([f.control() for f in inline.features] if inline is not None else None),
        "inline_layer": inline.layer if inline is not None else None,
        "inline_vectors": vector_asks(inline.vectors, alias.vector_params if alias is not None else ())
        if inline is not None
        else (),
        "sae_param": (alias.sae_param if alias is not None else None) or "steering.sae_id",
        "profile": profile,
        "intensity": req.steering_intensity,
    }


async def plan_generation(
    *,
    kind: str,
    req: ChatCompletionRequest | CompletionRequest,
    model: ModelRef,
    profile: str | None,
    client: EngineClient,
    attachments: list[AttachmentStatus] | None = None,
    status: EngineStatus | None = None,
    ignored_fields: list[str] | None = None,
    scope: Scope = EVERYONE,
    live_pinned: LiveScopes | None = None,
) -> Plan:
    """``live_pinned``: the live steering to run instead of this process's (a batch's
    creation-time snapshot of its key's scope)."""
    if attachments is None:
        attachments = await asyncio.to_thread(client.attachments)
    args = steering_args(req, profile)
    # the caller's own live-steering scope (keys on), an in-memory pick of live_copy's scopes
    args["live_scope"] = key_scope(scope.owner)
    args["show_scope"] = args["live_scope"] is not None or live_pinned is not None

    def resolve() -> tuple[ResolvedSteering, MonitorEntry | None]:
        # a profile or the live steering a request without its own falls back to, and
        # /api/monitoring's configuration when this process's copy is old: the database
        return (
            steering_resolve_request(attachments=attachments, model_name=model.name, live_values=live_pinned, **args),
            monitoring_request_entry(attachments=attachments),
        )

    config = monitoring_request_config()
    live = live_pinned
    if live is None and args["inline_features"] is None:
        live = live_copy.fresh()
    if config is not None and (args["inline_features"] is not None or (args["profile"] is None and live is not None)):
        # inline steering, or the live steering and the monitoring configuration as this
        # process holds them: nothing to read, so no thread hop before the first forward
        steering = steering_resolve_request(attachments=attachments, model_name=model.name, live_values=live, **args)
        monitored = monitoring_request_entry(attachments=attachments, config=config)
    else:
        steering, monitored = await off_view_thread(resolve)()
    n_prompts = len(req.conversations()) if isinstance(req, ChatCompletionRequest) else len(req.prompt)
    defaults = sampling_defaults(status)
    monitor = attachment = None
    if req.return_sae_activations is not None:
        first = req.sampling(0, defaults)
        max_tokens = first.max_tokens if first.max_tokens is not None else first.max_tokens_default
        monitor, attachment = monitor_resolve(
            asked=req.return_sae_activations, attachments=attachments, choices=n_prompts * req.n, max_tokens=max_tokens
        )
    monitor, monitored = monitoring_merge(monitor, monitored)  # /api/monitoring's entry
    fidelity = None
    if req.monitoring is not None and req.monitoring.fidelity:
        # every row read pre_steering, tagged apart from the request's own entries
        fidelity = fidelity_plan(
            asked=req.monitoring, attachments=attachments, status=status, backend=client.backend_name
        )
        monitor = MonitorSpec([*(monitor.entries if monitor is not None else []), *fidelity.monitor_entries()])
    analyses = await prepare_analyses(req, status, client.backend_name, scope)
    need = runtime().analyzers.need(analyses) if analyses else None
    probes = await plan_probes(req, status, n_prompts * req.n, scope)
    if probes is not None:
        entries = probes.monitor_entries()
        if entries:  # read per request by the engine's monitors, inside shared batches
            monitor = MonitorSpec([*(monitor.entries if monitor is not None else []), *entries])
        probe_need = probes.capture_need()
        if probe_need is not None:
            need = probe_need if need is None else need.merged(probe_need)
    sensing = await plan_sensing(status)
    if sensing is not None:  # tagged entries, read apart from the request's own
        monitor = MonitorSpec([*(monitor.entries if monitor is not None else []), *sensing.monitor_entries()])
    # the room left under CAPTURE_DIR_MAX_BYTES (a database read: off the loop)
    room = await off_view_thread(capture_room)() if req.capture is not None or need is not None else None
    capture = capture_spec(req, model.name, n_prompts * req.n, need=need, room=room)
    choices: list[Choice] = []
    tools = None
    namespace = cache_namespace(req.cache_namespace, scope)
    if isinstance(req, ChatCompletionRequest):
        # refused by name (field_not_honoured) where the loaded template renders no tools
        tools = tool_plan(req, status.capabilities if status is not None else None, model.name)
        for c, messages in enumerate(req.conversations()):
            for i in range(req.n):
                sampling = req.sampling(i, defaults)
                if tools is not None and tools.structured is not None:
                    sampling.structured = tools.structured  # the call's grammar
                choices.append(
                    Choice(
                        c * req.n + i,
                        GenerationJob(
                            request_id=f"chatcmpl-{uuid.uuid4().hex}",
                            messages=messages,
                            sampling=sampling,
                            steering=steering.spec,
                            monitor=monitor,
                            chat_template_kwargs=template_kwargs(req),
                            capture=capture,
                            tools=req.template_tools(),
                            cache_namespace=namespace,
                            priority=req.priority,
                        ),
                    )
                )
    else:
        if req.echo and req.wants_logprobs and req.stream:
            raise OpenAIError(
                "echo with logprobs is not available when streaming", status=400, code="invalid_parameter", param="echo"
            )
        for p, prompt in enumerate(req.prompt):
            for i in range(req.n):
                job_args: dict[str, Any] = (
                    {"prompt": prompt, "add_special_tokens": req.add_special_tokens}
                    if isinstance(prompt, str)
                    else {"prompt_token_ids": list(prompt)}
                )
                choices.append(
                    Choice(
                        p * req.n + i,
                        GenerationJob(
                            request_id=f"cmpl-{uuid.uuid4().hex}",
                            sampling=req.sampling(i, defaults),
                            steering=steering.spec,
                            monitor=monitor,
                            capture=capture,
                            cache_namespace=namespace,
                            priority=req.priority,
                            **job_args,
                        ),
                        prompt_text=prompt if isinstance(prompt, str) else None,
                        prompt_only=req.scores_only,
                    )
                )
    return Plan(
        kind=kind,
        request=req,
        model=model,
        steering=steering,
        monitor=monitor,
        attachment=attachment,
        choices=choices,
        backend=client.backend_name,
        monitoring=monitored,
        ignored_fields=list(ignored_fields or ()),
        fingerprint=wire.fingerprint(status, version()),
        analyses=analyses,
        probes=probes,
        tools=tools,
        sensing=sensing,
        fidelity=fidelity,
        scope=scope,
    )


def cache_namespace(key: str | None, scope: Scope) -> str | None:
    """The engine's prefix-cache namespace of a request's ``prompt_cache_key``: the key
    within its caller's (the API key's owner), so another key naming the same
    ``prompt_cache_key`` neither reuses nor probes its entries. None: the shared one."""
    if key is None:
        return None
    return "key-" + hashlib.sha256(f"{scope.owner}\0{key}".encode()).hexdigest()


async def plan_probes(
    req: ChatCompletionRequest | CompletionRequest, status: EngineStatus | None, choices: int, scope: Scope = EVERYONE
) -> ProbePlan | None:
    """The probes this request scores (``monitoring.probe_requests``): those it names, or the
    armed set (as this process holds it when fresh, else from the database)."""
    if status is None or (req.probes is not None and not req.probes):
        return None
    if req.probes is None:
        armed = armed_copy.fresh()
        if armed is not None:
            return probe_request_plan(asked=None, status=status, choices=choices, armed=armed)
    return await off_view_thread(probe_request_plan)(asked=req.probes, status=status, choices=choices, scope=scope)


async def plan_sensing(status: EngineStatus | None) -> SensingPlan | None:
    """The clusters and circuits this request watches (``monitoring.sensing``): the active
    ones and those armed for sensing, as this process holds them when fresh."""
    if status is None:
        return None
    watches = watch_copy.fresh()
    if watches is None:
        watches = await off_view_thread(watch_copy.read)()
    return sensing_request_plan(status=status, watches=watches)


async def prepare_analyses(
    req: ChatCompletionRequest | CompletionRequest, status: EngineStatus | None, backend: str, scope: Scope = EVERYONE
) -> list[PreparedAnalysis]:
    """The request's ``analyze`` entries, validated before anything runs: an unknown
    name (the message lists the known ones), params or a probe file the analyzer
    refuses, or a capture the loaded backend cannot take are 400s."""
    if not req.analyze:
        return []
    analyzers = runtime().analyzers
    # off the event loop: preparing reads probe files
    # the caller's scope: an analyzer reads only stored captures the caller may see
    analyses = await analyzers.aprepare([(a.name, a.params) for a in req.analyze], scope)
    analysis_check_backend(
        need=analyzers.need(analyses),
        capabilities=status.capabilities if status is not None else None,
        backend=(status.backend if status is not None else None) or backend,
        analyzers=[a.name for a in analyses],
    )
    return analyses


def capture_spec(
    req: ChatCompletionRequest | CompletionRequest,
    model: str,
    choices: int,
    need: CaptureNeed | None = None,
    room: int | None = None,
) -> CaptureSpec | None:
    """The engine's capture spec of a request's ``capture`` field united with what its
    analyzers read (``need``), with the CAPTURE_* limits: one choice only (the response
    holds one capture)."""
    asked = req.capture
    if asked is None and need is None:
        return None
    if choices != 1:
        param = "capture" if asked is not None else "analyze"
        raise OpenAIError(
            f"{param} takes one choice: send one prompt with n = 1", status=400, code="invalid_parameter", param=param
        )
    limits = capture_limits(model, room)
    base = None
    if asked is not None:
        att = asked.attention
        attention = (
            None
            if att is None
            else AttentionCaptureSpec(
                layers=list(att.layers),
                heads=list(att.heads) if att.heads is not None else None,
                positions=att.positions,
                q_positions=att.q_positions,
            )
        )
        base = CaptureSpec(layers=list(asked.layers), positions=asked.positions, attention=attention, **limits)
    return base if need is None else capture_spec_for(need, base, **limits)


def capture_limits(model: str, room: int | None = None) -> dict[str, Any]:
    """The CAPTURE_* limits every capture the web tier asks for carries; ``room``: what is
    left under CAPTURE_DIR_MAX_BYTES (None: no quota)."""
    return {
        "max_bytes": int(settings.CAPTURE_MAX_BYTES),
        "inline_max_bytes": int(settings.CAPTURE_INLINE_MAX_BYTES),
        "directory": str(settings.CAPTURE_DIR),
        "model": model,
        "store_max_bytes": room,
    }


def sampling_defaults(status: EngineStatus) -> SamplingDefaults:
    """What a request that sends no temperature, top_p or max_tokens gets: on an engine
    that batches, the CBM_DEFAULT_* settings (max_tokens a ceiling that a long prompt
    shrinks, never a refusal); else OpenAI's defaults."""
    if not (status.batching or {}).get("enabled"):
        return OPENAI_DEFAULTS
    return SamplingDefaults(
        temperature=float(settings.CBM_DEFAULT_TEMPERATURE),
        top_p=float(settings.CBM_DEFAULT_TOP_P),
        max_tokens=int(settings.CBM_DEFAULT_MAX_TOKENS),
    )


async def resolve_model(name: str, status: EngineStatus) -> tuple[ModelRef, str | None]:
    """The registry row a request names (and the profile of ``model@profile``). The
    resident model is answered from the engine's status without a database query: it was
    loaded from its row, and a loaded model's row cannot be deleted."""
    if status.state == "ready" and status.model_id == name:
        return ModelRef(None, name, "loaded", status.hidden_size), None
    return await sync_to_async(selectors.model_resolve)(name=name)
