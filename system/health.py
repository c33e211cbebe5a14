"""/api/health: liveness, readiness, the detailed breakdown, inference backend, GPUs,
metrics, circuit breakers, version.

Readiness rule (documented in docs/api.md): the server is ready when
1. the database answers a query,
2. every engine of ENGINE_MODELS (the one default engine when it is unset) answers
   ``status()`` and reports no ``failure`` (``engines`` says which one does not),
3. no model load or unload is running (a swap in progress would answer 503 model_busy),
4. the AUTO_LOAD_MODEL, when one is configured, is resident on its engine (or the model a restart
   restored and the setting could not swap out: ``auto_load_model`` says which and why).
Otherwise 503 NOT_READY with Retry-After RETRY_AFTER_READINESS_S and the failing checks in
``details.checks``. Having no model loaded is not a failure by itself: /v1 loads a
registered model on demand and the management API works without one.
"""

from __future__ import annotations

import json
import platform
import time
from datetime import UTC, datetime
from typing import Any

import structlog
from django.conf import settings
from django.db import connection
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope
from core.auth import keys_enabled
from core.engines import DEFAULT_ENGINE, engine_for_model, primary_engine
from core.engine_options import interactive_slots
from core.errors import NotReady
from core.schema import enveloped
from core.version import version
from inference.capabilities import batching_enabled, served_capabilities
from leases.selectors import lease_live, lease_out
from orchestration.services import model_jobs_reap
from orchestration.startup import auto_load_state
from registry.errors import ModelNotFound
from registry.maintenance import model_by_name_or_id
from registry.models import Job, Model
from steering.models import Cluster, Profile
from system.figures import engine_snapshots, inference_figures

log = structlog.get_logger(__name__)

STARTED_AT = time.time()


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _check_database() -> dict[str, Any]:
    started = time.perf_counter()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # noqa: BLE001
        return {"name": "database", "status": "unhealthy", "message": type(exc).__name__}
    return {
        "name": "database",
        "status": "healthy",
        "vendor": connection.vendor,
        "latency_ms": round((time.perf_counter() - started) * 1000, 2),
    }


def _check_engine(engine: dict[str, Any], name: str = DEFAULT_ENGINE) -> dict[str, Any]:
    # the first engine's component keeps the name "engine" (one engine: as before), the
    # others are "engine:<name>"; each says which engine it is in "engine"
    label = {"name": "engine" if name == primary_engine() else f"engine:{name}", "engine": name}
    if engine["state"] == "unavailable":
        return {**label, "status": "unhealthy", "message": engine.get("error")}
    if engine.get("failure"):
        # loaded, but its backend's engine died (vLLM's engine core): every request refused
        return {**label, "status": "unhealthy", "message": engine["failure"]}
    loaded = engine["state"] == "ready"
    return {
        **label,
        "status": "healthy" if loaded else "degraded",
        "message": f"model {engine.get('model_id')} resident" if loaded else "no model loaded",
    }


def _engine_ok(engine: dict[str, Any]) -> bool:
    return engine["state"] != "unavailable" and not engine.get("failure")


def _engine_entry(name: str, engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "alive": engine["state"] != "unavailable",
        "ready": _engine_ok(engine),
        "state": engine["state"],
        "model_name": engine.get("model_id"),
        "engine_failure": engine.get("failure"),
        "error": engine.get("error"),
    }


def _check_channel_layer() -> dict[str, Any]:
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return {"name": "channel_layer", "status": "unhealthy", "message": "not configured"}
    return {"name": "channel_layer", "status": "healthy", "backend": type(layer).__name__}


def _model_transition() -> dict[str, Any] | None:
    model_jobs_reap()  # a load or unload whose worker died is not a transition
    moving = (
        Model.objects.filter(status__in=(Model.Status.LOADING, Model.Status.UNLOADING))
        .values_list("name", "status")
        .first()
    )
    if moving is not None:
        return {"model": moving[0], "status": moving[1]}
    job = (
        Job.objects.filter(kind__in=(Job.Kind.MODEL_LOAD, Job.Kind.MODEL_UNLOAD), status=Job.Status.RUNNING)
        .values_list("target", "kind")
        .first()
    )
    if job is not None:
        return {"model": job[0], "status": "loading" if job[1] == Job.Kind.MODEL_LOAD else "unloading"}
    return None


def _auto_load_engine(snapshots: dict[str, dict[str, Any]], primary: dict[str, Any]) -> dict[str, Any]:
    """The snapshot of the engine AUTO_LOAD_MODEL belongs to, else the first engine's."""
    if not settings.AUTO_LOAD_MODEL or len(snapshots) < 2:
        return primary
    try:
        model = model_by_name_or_id(settings.AUTO_LOAD_MODEL)
    except ModelNotFound:
        return primary
    return snapshots.get(engine_for_model(model.name) or "", primary)


def readiness() -> tuple[bool, dict[str, Any]]:
    checks: dict[str, Any] = {}
    database = _check_database()
    checks["database"] = database["status"] == "healthy"
    snapshots = engine_snapshots()
    engine = snapshots[primary_engine()]
    # every engine answers, and none holds a model whose backend died
    # (EngineStatus.failure): that model's requests would all be refused
    checks["engine"] = all(_engine_ok(e) for e in snapshots.values())
    transition = _model_transition() if checks["database"] else None
    checks["no_model_transition"] = transition is None
    # AUTO_LOAD_MODEL's engine (ENGINE_MODELS): where its start-up load goes
    auto_engine = _auto_load_engine(snapshots, engine) if checks["database"] else engine
    if settings.AUTO_LOAD_MODEL:
        # the start-up's model is resident: AUTO_LOAD_MODEL's, or the one the registry
        # recorded, which a restart restored and the setting then leaves in place
        checks["auto_load_model"] = auto_engine.get("model_id") is not None
    ready = all(checks.values())
    auto_load = auto_load_state(auto_engine.get("model_id")) if checks["database"] else None
    data = {
        "ready": ready,
        "checks": checks,
        "model_loaded": engine.get("state") == "ready",
        "model_name": engine.get("model_id"),
        "engine_failure": engine.get("failure"),
        # each engine of ENGINE_MODELS; the top-level model and failure are the first's
        "engines": [_engine_entry(name, e) for name, e in snapshots.items()],
        "failed_engines": [name for name, e in snapshots.items() if not _engine_ok(e)],
        "transition": transition,
        "version": version(),
        "timestamp": _now(),
    }
    if auto_load is not None:
        # AUTO_LOAD_MODEL against what is resident, and why another model holds the engine
        data["auto_load_model"] = auto_load
    return ready, data


# --- GPUs ---------------------------------------------------------------------------------


def gpu_cards() -> tuple[list[dict[str, Any]], str | None]:
    """Per-card memory, or no cards and the reason; never invented zeros."""
    if not settings.EMBEDDED:
        return [], ("distributed mode: the GPUs belong to the run_engine process; this web process does not use CUDA")
    try:
        import torch
    except ImportError:
        return [], "torch is not installed in this process"
    if not torch.cuda.is_available():
        return [], "no CUDA device is visible to this process (torch.cuda.is_available() is false)"
    cards = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        # mem_get_info asks the driver (a CUDA context on that card), so what other
        # processes hold is included, as nvidia-smi shows it.
        free, total = torch.cuda.mem_get_info(index)
        cards.append(
            {
                "index": index,
                "name": props.name,
                "memory_total_mb": round(total / 2**20),
                "memory_used_mb": round((total - free) / 2**20),
                "memory_free_mb": round(free / 2**20),
                "allocated_by_millm_mb": round(torch.cuda.memory_allocated(index) / 2**20),
                "reserved_by_millm_mb": round(torch.cuda.memory_reserved(index) / 2**20),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    return cards, None


# --- views --------------------------------------------------------------------------------

_any = serializers.JSONField()


class LivenessView(APIView):
    @extend_schema(
        summary="Liveness: the process answers",
        tags=["health"],
        responses=enveloped(
            inline_serializer(
                "Liveness",
                {
                    "status": serializers.CharField(),
                    "version": serializers.CharField(),
                    "timestamp": serializers.CharField(),
                    "uptime_seconds": serializers.FloatField(),
                    "access": serializers.DictField(),
                },
            )
        ),
    )
    def get(self, request) -> Response:
        return envelope(
            {
                "status": "healthy",
                "version": version(),
                "timestamp": _now(),
                "uptime_seconds": round(time.time() - STARTED_AT, 3),
                "access": access_summary(),
            }
        )


def access_summary() -> dict[str, Any]:
    """Which surfaces need which key (never a key): for clients and probes to check."""
    on = keys_enabled()
    return {
        "keys_required": on,
        "inference_keys": len(settings.MILLM_API_KEYS),
        "admin_keys": len(settings.MILLM_ADMIN_API_KEYS),
        "protected": ["/v1", "/api (but /api/health and /api/health/ready)", "/ws/events"] if on else [],
        "admin_only": "changes of shared state on /api (registry, load and unload, attach, "
        "live steering, documents, leases)"
        if on
        else None,
        "open": ["/api/health", "/api/health/ready"],
        "browser_origins": "*"
        if getattr(settings, "CORS_ALLOW_ALL_ORIGINS", False)
        else list(getattr(settings, "CORS_ALLOWED_ORIGINS", [])),
        "remote_code": bool(getattr(settings, "ALLOW_REMOTE_CODE", False)),
    }


class ReadinessView(APIView):
    @extend_schema(
        summary="Readiness (503 + Retry-After while not ready)",
        tags=["health"],
        responses={
            200: enveloped(_any),
            503: OpenApiResponse(description="Not ready: error NOT_READY, failing checks in details"),
        },
    )
    def get(self, request) -> Response:
        ready, data = readiness()
        if not ready:
            failing = sorted(k for k, ok in data["checks"].items() if not ok)
            if data["failed_engines"]:
                # which engine: "engine (gpu1: <its failure>)"
                said = [
                    f"{e['name']}: {e['engine_failure'] or e['error'] or e['state']}"
                    for e in data["engines"]
                    if not e["ready"]
                ]
                failing = [f"engine ({'; '.join(said)})" if k == "engine" else k for k in failing]
            raise NotReady(
                "Not ready: " + ", ".join(failing), details=data, retry_after=settings.RETRY_AFTER_READINESS_S
            )
        return envelope(data)


class DetailedHealthView(APIView):
    @extend_schema(
        summary="Components, circuit breakers, inference queue, model and SAEs",
        tags=["health"],
        responses=enveloped(_any),
    )
    def get(self, request) -> Response:
        from registry import hub, selectors

        snapshots = engine_snapshots()
        engine = snapshots[primary_engine()]
        components = [
            _check_database(),
            *(_check_engine(e, name) for name, e in snapshots.items()),
            _check_channel_layer(),
        ]
        circuits = hub.circuit_states()
        for circuit in circuits:
            components.append(
                {
                    "name": f"{circuit['name']}_circuit",
                    "status": "degraded" if circuit["is_open"] else "healthy",
                    "message": f"circuit {circuit['state']}",
                }
            )
        worst = (
            "unhealthy"
            if any(c["status"] == "unhealthy" for c in components)
            else "degraded"
            if any(c["status"] == "degraded" for c in components)
            else "healthy"
        )
        attachments = engine.get("attachments", [])
        resident = selectors.model_loaded()
        ready, ready_data = readiness()
        return envelope(
            {
                "status": worst,
                "ready": ready,
                "readiness_checks": ready_data["checks"],
                "version": version(),
                "timestamp": _now(),
                "uptime_seconds": round(time.time() - STARTED_AT, 3),
                "mode": "embedded" if settings.EMBEDDED else "distributed",
                "components": components,
                "circuit_breakers": circuits,
                "model_loaded": engine.get("state") == "ready",
                "model_name": engine.get("model_id"),
                "model_id": resident.pk if resident else None,
                "device": engine.get("device"),
                "dtype": engine.get("dtype"),
                "sae_attached": bool(attachments),
                "attachments": [
                    {
                        "sae_id": a["sae_id"],
                        "layer": a["layer"],
                        "layer_module_path": a["layer_module_path"],
                        "hook_point": a.get("hook_point", "resid_post"),
                        "steering_apply_count": a.get("steering_apply_count", 0),
                    }
                    for a in attachments
                ],
                "inference": {
                    **inference_figures(),
                    "backend": engine.get("backend"),
                    "continuous_batching": settings.ENABLE_CONTINUOUS_BATCHING,
                },
                "lease": _lease_block(),
                "active_profile": _active_profile(),
            }
        )


def _active_profile() -> dict[str, Any] | None:
    """The active profile or cluster (one at a time): ``{id, name, source_kind, intensity}``."""
    for model, kind in ((Profile, "manual"), (Cluster, "cluster")):
        row = model.objects.filter(is_active=True).first()
        if row is not None:
            return {"id": row.pk, "name": row.name, "source_kind": kind, "intensity": row.intensity}
    return None


def _lease_block() -> dict[str, Any] | None:
    """The live lease, without its id (which is shown once, to its holder)."""
    lease = lease_live()
    return lease_out(lease) if lease is not None else None


class InferenceHealthView(APIView):
    @extend_schema(summary="Active inference backend and its capabilities", tags=["health"], responses=enveloped(_any))
    def get(self, request) -> Response:
        snapshots = engine_snapshots()
        engine = snapshots[primary_engine()]
        # what the engine actually runs (its own report), else what the settings ask for
        engine_batching = engine.get("batching") or {}
        batching = batching_enabled(engine)
        slots = interactive_slots(engine.get("backend") or "none")
        return envelope(
            {
                # the loaded model's backend (None while nothing is loaded), the one a model
                # without its own choice loads on, and every backend the engine's host knows
                "backend": engine.get("backend"),
                "default_backend": settings.MILLM_BACKEND,
                "backends": engine.get("backends") or [],
                "mode": engine_batching.get("mode") or ("continuous_batching" if batching else "serial"),
                "batching": engine_batching,
                "kernels": engine.get("kernels"),
                # the resident weights: Q8/Q4 applied at load or a checkpoint's own method,
                # and the bytes they take per dtype; empty while nothing is loaded
                "weights": engine.get("weights") or {},
                # what the backend keeps between requests and its idle releases
                # (TRANSFORMERS_IDLE_CACHE_RELEASE_S); empty while nothing is loaded
                "memory": engine.get("memory") or {},
                "engine_state": engine["state"],
                # why the loaded model cannot serve (vLLM's engine core died), else null
                "engine_failure": engine.get("failure"),
                "model_name": engine.get("model_id"),
                # the slots in force for the loaded backend, and the setting they come from
                # (MAX_CONCURRENT_REQUESTS unset follows the backend: vLLM's VLLM_MAX_NUM_SEQS)
                "max_concurrent_requests": slots.value,
                "slots": slots.to_dict(),
                "max_pending_requests": settings.MAX_PENDING_REQUESTS,
                "queue": inference_figures(),
                # as the loaded backend reports them (empty while nothing is loaded), plus
                # what the web tier itself provides
                # one builder with /v1/capabilities, so the two never disagree
                "capabilities": served_capabilities(engine),
                "limitations": []
                if batching
                else ["serial backend: one generation at a time, others wait in the queue"],
                # every engine of ENGINE_MODELS (the top-level fields are the first's)
                "engines": [
                    {
                        "name": name,
                        "engine_state": e["state"],
                        "backend": e.get("backend"),
                        "model_name": e.get("model_id"),
                        "weights": e.get("weights") or {},
                        "engine_failure": e.get("failure"),
                        "error": e.get("error"),
                    }
                    for name, e in snapshots.items()
                ],
            }
        )


class GpusView(APIView):
    @extend_schema(
        summary="Per-card GPU memory (cards: [] with a reason where there is none)",
        tags=["health"],
        responses=enveloped(_any),
    )
    def get(self, request) -> Response:
        cards, reason = gpu_cards()
        return envelope({"cards": cards, "total": len(cards), "reason": reason})


class MetricsView(APIView):
    @extend_schema(summary="Metrics as JSON", tags=["health"], responses=enveloped(_any))
    def get(self, request) -> Response:
        from system import metrics

        return envelope(metrics.snapshot())


class _PlainTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data if isinstance(data, (bytes, str)) else json.dumps(data)


class PrometheusView(APIView):
    # Scrapers and curl ask for text/plain; JSON stays available for error answers.
    renderer_classes = (_PlainTextRenderer, JSONRenderer)

    @extend_schema(
        summary="Metrics in the Prometheus text format (not enveloped)",
        tags=["health"],
        responses={(200, "text/plain"): OpenApiResponse(description="exposition")},
    )
    def get(self, request):
        from django.http import HttpResponse
        from prometheus_client import CONTENT_TYPE_LATEST

        from system import metrics

        return HttpResponse(metrics.prometheus_text(), content_type=CONTENT_TYPE_LATEST)


class CircuitsView(APIView):
    @extend_schema(summary="Circuit breakers (the hub's)", tags=["health"], responses=enveloped(_any))
    def get(self, request) -> Response:
        from registry import hub

        circuits = hub.circuit_states()
        return envelope({"circuits": circuits, "total": len(circuits)})


class CircuitResetView(APIView):
    @extend_schema(summary="Close a tripped circuit breaker", tags=["health"], request=None, responses=enveloped(_any))
    def post(self, request, name: str) -> Response:
        from registry import hub

        return envelope(hub.circuit_reset(name=name))


class VersionView(APIView):
    @extend_schema(summary="Version", tags=["health"], responses=enveloped(_any))
    def get(self, request) -> Response:
        import django

        return envelope(
            {"app": "miLLM", "version": version(), "python": platform.python_version(), "django": django.get_version()}
        )
