"""``GET /v1/capabilities``: what each served model offers — its backend, what that backend
does per request (hook points, steering controls and mode, monitoring, capture, structured
output, tools, embeddings, scoring, compiled graphs, prefix caching) and the limits a
request meets.

One source with ``/api/health/inference``: both read the engine's own status, and both
build their ``capabilities`` object with ``served_capabilities``, so the two never
disagree. The resident model answers with the engine's live report; a registered model
that is not resident names the backend it would load on and whether that backend is
installed, with ``capabilities: null`` (a backend's report depends on the model it loads:
its hook points, its chat template's tools, its kernels) and the limits that do not
depend on the load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from pydantic import BaseModel

from core.engine_options import interactive_slots
from core.engines import DEFAULT_ENGINE, engine_for_model, several_engines
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from gpu_engine.api.fields import MAX_LOGIT_BIAS, MAX_STOP_SEQUENCES, MAX_TOP_LOGPROBS
from gpu_engine.api.protocol import EngineStatus, to_builtins
from inference import selectors
from inference.errors import openai_view
from inference.planning import sampling_defaults
from inference.protocol import (
    MAX_ACTIVATION_FEATURES,
    MAX_ACTIVATION_TOP_K,
    MAX_EXTRA_CONVERSATIONS,
    MAX_N,
    MAX_TOOLS,
    InlineSteering,
)
from inference.protocol_extensions import MAX_INLINE_VECTORS


def served_capabilities(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The ``capabilities`` object of ``/api/health/inference`` and of each resident entry
    of ``/v1/capabilities``: the loaded backend's report (``engine``: the engine's status
    as JSON; empty while nothing is loaded) and what the web tier itself provides."""
    batching = engine.get("batching") or {}
    return {
        "streaming": True,
        # the loaded backend says (SPECULATIVE_MODEL on the transformers backend)
        "speculative_decoding": False,
        **batching.get("capabilities", {}),
        "continuous_batching": batching_enabled(engine),
    }


def batching_enabled(engine: Mapping[str, Any]) -> bool:
    """Whether the engine batches: its own report, else what the settings ask for."""
    batching = engine.get("batching") or {}
    return bool(batching.get("enabled", settings.ENABLE_CONTINUOUS_BATCHING))


def _max_length(model: type[BaseModel], field: str) -> int | None:
    """A list field's ``max_length`` as its wire model declares it."""
    for meta in model.model_fields[field].metadata:
        if hasattr(meta, "max_length"):
            return int(meta.max_length)
    return None


def _limits(backend: str, context_length: int | None) -> dict[str, Any]:
    """The limits a request meets that do not depend on what is loaded."""
    slots = interactive_slots(backend)
    return {
        "context_length": context_length,
        "max_n": MAX_N,
        "max_choices": MAX_N * 4,  # conversations (or prompts) × n
        "max_extra_conversations": MAX_EXTRA_CONVERSATIONS,
        "max_stop_sequences": MAX_STOP_SEQUENCES,
        "max_top_logprobs": MAX_TOP_LOGPROBS,
        "max_logit_bias": MAX_LOGIT_BIAS,
        "max_tools": MAX_TOOLS,
        "max_steering_features": _max_length(InlineSteering, "features"),
        "max_steering_vectors": MAX_INLINE_VECTORS,
        "max_activation_features": MAX_ACTIVATION_FEATURES,
        "max_activation_top_k": MAX_ACTIVATION_TOP_K,
        "capture_max_bytes": int(settings.CAPTURE_MAX_BYTES),
        "capture_inline_max_bytes": int(settings.CAPTURE_INLINE_MAX_BYTES),
        # /v1's slots for this backend (as /api/health/inference's max_concurrent_requests)
        "max_concurrent_requests": slots.value,
        "max_pending_requests": int(settings.MAX_PENDING_REQUESTS),
    }


def _resident(name: str, status: EngineStatus, engine: Mapping[str, Any]) -> dict[str, Any]:
    batching = engine.get("batching") or {}
    limits = _limits(status.backend or "none", status.context_length)
    limits.update(
        # the rows one batch runs (None: serial, one generation at a time)
        max_batch_rows=batching.get("max_batch_size") if batching_enabled(engine) else None,
        # a request that sends no max_tokens: chat fills the window (None) or the ceiling
        # CBM_DEFAULT_MAX_TOKENS on an engine that batches
        default_max_tokens=sampling_defaults(status).max_tokens,
    )
    return {
        "id": name,
        "object": "model.capabilities",
        "resident": True,
        "backend": status.backend,
        "backend_available": True,
        "mode": batching.get("mode") or ("continuous_batching" if batching_enabled(engine) else "serial"),
        "device": status.device,
        "dtype": status.dtype,
        "num_layers": status.num_layers,
        "hidden_size": status.hidden_size,
        "capabilities": served_capabilities(engine),
        "limits": limits,
    }


def _registered(row: Any, backends: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    backend = row.effective_backend()
    limits = _limits(backend, row.context_length)
    limits.update(max_batch_rows=None, default_max_tokens=None)
    return {
        "id": row.name,
        "object": "model.capabilities",
        "resident": False,
        "backend": backend,
        # installed on the engine's host (its packages import); loading is an admin's call
        "backend_available": bool((backends.get(backend) or {}).get("available")),
        "mode": None,
        "device": None,
        "dtype": None,
        "num_layers": row.num_layers,
        "hidden_size": row.hidden_size,
        # known once resident: a backend reports them for the model it has loaded
        "capabilities": None,
        "limits": limits,
    }


def capabilities_list(
    rows: list[Any], statuses: Mapping[str | None, EngineStatus | None], engine_of: Callable[[str], str | None]
) -> dict[str, Any]:
    """``/v1/capabilities``: one entry per listed model (``rows``: /v1/models' models,
    without the ``@profile`` entries), each answered by the engine that holds or would hold
    it (``engine_of``, ENGINE_MODELS): the resident one from that engine's live status, a
    registered one with that engine's backends. ``statuses``: each engine's status by
    name, None for an engine that did not answer (its models: ``backend_available``
    false); a model no engine may hold has ``engine: null``."""
    data = []
    for row in rows:
        name = engine_of(row.name)
        status = statuses.get(name)
        if status is None:
            entry = _registered(row, {})
        elif status.state == "ready" and status.model_id == row.name:
            entry = _resident(row.name, status, to_builtins(status))
        else:
            entry = _registered(row, {b.get("name"): b for b in status.backends})
        data.append({**entry, "engine": name})
    return {"object": "list", "data": data}


def _engine_status(client: Any, several: bool) -> EngineStatus | None:
    try:
        return client.status()
    except EngineError:
        if not several:
            raise  # one engine: as before, its error answers
        return None  # one engine down does not hide the others' models


@openai_view("GET")
async def capabilities(request: HttpRequest):
    """The route: read as /v1/models is (an inference key may)."""
    rows = await sync_to_async(lambda: list(selectors.models_listed()))()
    several = several_engines()
    engine_of = engine_for_model if several else (lambda _name: DEFAULT_ENGINE)
    statuses: dict[str | None, EngineStatus | None] = {}
    for name in dict.fromkeys(engine_of(row.name) for row in rows):
        if name is None:
            continue
        client = runtime().engines.client(name) if several else runtime().engine
        statuses[name] = (
            await asyncio.to_thread(_engine_status, client, several)
            if client.status_blocks
            else _engine_status(client, several)
        )
    return JsonResponse(capabilities_list(rows, statuses, engine_of))


__all__ = ["batching_enabled", "capabilities", "capabilities_list", "served_capabilities"]
