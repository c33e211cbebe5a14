"""What the web tier does when the engine reports something on its own (not in answer to
a call): today, an out-of-memory error that made it detach SAEs."""

from __future__ import annotations

import structlog
from django.db import close_old_connections

from core import events
from gpu_engine.api.protocol import EngineEvent
from orchestration import services
from registry.models import Model

log = structlog.get_logger(__name__)


def handle(event: EngineEvent) -> None:
    if event.name == "sae:detached" and event.data.get("reason") == "out_of_memory":
        close_old_connections()
        try:
            services.attachment_forget(sae_id=event.data["sae_id"], layer=event.data["layer"])
        finally:
            close_old_connections()
        events.publish(
            "sae:detached", {"sae_id": event.data["sae_id"], "layer": event.data["layer"], "reason": "out_of_memory"}
        )
    elif event.name == "engine:out_of_memory":
        log.error("engine_out_of_memory", detached=event.data.get("detached"))
    elif event.name == "memory:released":
        # TRANSFORMERS_IDLE_CACHE_RELEASE_S: the operator's dashboards see it happen

        name = event.data.get("model_id")  # the engine knows its model by name
        close_old_connections()
        try:
            model_id = Model.objects.filter(name=name).values_list("pk", flat=True).first()
        finally:
            close_old_connections()
        log.info("engine_memory_released", bytes=event.data.get("bytes"), model=name)
        events.publish("memory:released", {"bytes": event.data.get("bytes"), "model_id": model_id, "model_name": name})
