"""What each engine holds, for ``GET /api/engines`` and the operators: the engines the
front routes to (``core.engines``, ENGINE_MODELS), whether each is alive, the model it
holds by its own status, and the model the registry records on it."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core.engines import DEFAULT_ENGINE, engine_names, engine_patterns, engine_prefix
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from registry.models import Model


def _embedded_entry(name: str) -> dict[str, Any]:
    # the engine's client in this process, if it was started: a report must not start one
    client = runtime().engines.built(name)
    if client is None:
        return {"alive": False, "phase": "not_started", "state": None, "model": None, "engine_id": None}
    status = client.status()
    return {
        "alive": True,
        "phase": "serving",
        "state": status.state,
        "model": status.model_id if status.state == "ready" else None,
        "engine_id": None,
    }


def _redis_entry(name: str) -> dict[str, Any]:
    try:
        beat = runtime().engines.client(name).heartbeat()
    except EngineError:
        beat = None
    if beat is None:
        return {"alive": False, "phase": "unavailable", "state": None, "model": None, "engine_id": None}
    status = beat.get("status") or {}
    return {
        "alive": True,
        "phase": beat.get("phase"),
        "state": status.get("state"),
        "model": status.get("model_id") if status.get("state") == "ready" else None,
        "engine_id": beat.get("engine_id"),
    }


def engines_report() -> list[dict[str, Any]]:
    """One entry per engine: its name, Redis prefix (distributed mode), the models it may
    hold (ENGINE_MODELS), whether it is alive, the model its status says it holds, and
    the model rows the registry records on it (loading, loaded or unloading)."""
    names = engine_names()
    recorded: dict[str, list[str]] = {name: [] for name in names}
    moving = Model.objects.filter(
        status__in=(Model.Status.LOADING, Model.Status.LOADED, Model.Status.UNLOADING)
    ).order_by("name")
    for row in moving:
        # a row from before engines had names belongs to the default engine
        recorded.setdefault(row.engine or DEFAULT_ENGINE, []).append(row.name)
    out = []
    for name in names:
        live = _embedded_entry(name) if settings.EMBEDDED else _redis_entry(name)
        out.append(
            {
                "name": name,
                "prefix": None if settings.EMBEDDED else engine_prefix(name),
                "models_allowed": list(engine_patterns(name)),
                **live,
                "recorded": recorded.get(name, []),
            }
        )
    return out
