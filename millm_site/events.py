"""The event bus: services publish ``{"event": name, "data": {...}}`` to every WebSocket
client of ``/ws/events`` through the Channels layer (in-memory embedded, Redis otherwise).

Payload keys are snake_case and never carry prompt text.
"""

from __future__ import annotations

from typing import Any

import structlog
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = structlog.get_logger(__name__)

GROUP = "millm.events"


def publish(event: str, data: dict[str, Any]) -> None:
    """Send one event; a failing channel layer is logged, never raised into the caller."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(GROUP, {"type": "millm.event", "event": event,
                                                "data": data})
    except Exception:  # noqa: BLE001 - an event must never break the operation it reports
        log.warning("event_publish_failed", event_name=event, exc_info=True)
