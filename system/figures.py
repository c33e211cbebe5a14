"""Figures /api/health and the metrics share: the engine's status and /v1's queue.

Their own module so that system.health (the views) and system.metrics (the collectors)
both import them and not each other.
"""

from __future__ import annotations

from typing import Any

import structlog
from django.conf import settings

from core.engine_options import interactive_slots
from core.engines import engine_names
from core.runtime import runtime
from gpu_engine.api.protocol import to_builtins
from inference.admission import queue_figures

log = structlog.get_logger(__name__)


def engine_snapshot(name: str | None = None) -> dict[str, Any]:
    """An engine's own status as plain JSON, or ``state: unavailable`` and why: engine
    ``name`` of ENGINE_MODELS, else the one the running code addresses (the default one
    outside ``core.engines.using_engine``)."""
    try:
        client = runtime().engine if name is None else runtime().engines.client(name)
        status = client.status()
    except Exception as exc:  # noqa: BLE001 - health must answer whatever the engine does
        return {"state": "unavailable", "error": getattr(exc, "message", str(exc)), "attachments": []}
    data = to_builtins(status)
    data.pop("model_path", None)
    return data


def engine_snapshots() -> dict[str, dict[str, Any]]:
    """Every engine of ENGINE_MODELS by name (``default`` alone when it is unset), each as
    ``engine_snapshot`` answers it."""
    return {name: engine_snapshot(name) for name in engine_names()}


def inference_figures() -> dict[str, Any]:
    """pending / in flight / waiting / estimated_wait_seconds from /v1's admission, with
    the slots in force and the setting they come from (``slots_source``)."""
    slots = interactive_slots()
    try:
        figures = dict(queue_figures())
    except Exception as exc:  # noqa: BLE001 - the /v1 tier may not be importable yet
        log.warning("queue_figures_unavailable", error=repr(exc))
        figures = {
            "slots": slots.value,
            "max_pending": settings.MAX_PENDING_REQUESTS,
            "in_flight": None,
            "waiting": None,
            "pending": None,
            "estimated_wait_seconds": None,
        }
    # where the slots come from: MAX_CONCURRENT_REQUESTS, or with it unset the loaded backend
    figures["slots_source"] = slots.source
    return figures
