"""The event bus: services publish ``{"event": name, "data": {...}}`` to every WebSocket
client of ``/ws/events`` through the Channels layer (in-memory embedded, Redis otherwise).

Payload keys are snake_case and never carry prompt text.

Embedded mode needs one extra step: the in-memory layer's queues belong to the server's
event loop, and a worker thread (a download, a load) that wrote to them from its own loop
would not wake that loop up, so an event could sit unseen until the next unrelated wake-up.
The consumer therefore records the server's loop (``bind_loop``) and publishing from any
other thread hands the send to that loop. Events from one thread keep their order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any

import structlog
from asgiref.sync import async_to_sync
from channels.layers import InMemoryChannelLayer, get_channel_layer

from core.runtime import runtime

log = structlog.get_logger(__name__)

GROUP = "millm.events"
# An event's data may name the owner of what it is about (a batch, a request's monitoring):
# /ws/events then sends it only to that owner's sockets and to admin keys, without the field
# (millm_site.consumers).
OWNER_FIELD = "_owner"


class EventBus:
    """The process's publisher (a runtime part: ``runtime().events``), which remembers the
    loop that serves WebSocket consumers."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._loop = loop

    def publish(self, event: str, data: dict[str, Any]) -> None:
        _publish(self._loop, event, data)


def bind_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Remember the loop that serves WebSocket consumers (called on every connect)."""
    runtime().events.bind_loop(loop)


def _message(event: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": "millm.event", "event": event, "data": data}


async def send_to(channel_names: Iterable[str], event: str, data: dict[str, Any]) -> None:
    """Send one event to some consumers only, from the loop that serves them (the
    metrics push, whose figures belong to this process). Failures are logged."""
    layer = get_channel_layer()
    if layer is None:
        return
    for name in channel_names:
        try:
            await layer.send(name, _message(event, data))
        except Exception:
            log.warning("event_send_failed", event_name=event, exc_info=True)


def _log_failure(future: Any, event: str) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("event_publish_failed", event_name=event, error=repr(exc))


def publish(event: str, data: dict[str, Any]) -> None:
    """Send one event; a failing channel layer is logged, never raised into the caller."""
    runtime().events.publish(event, data)


def _publish(loop: asyncio.AbstractEventLoop | None, event: str, data: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        if isinstance(layer, InMemoryChannelLayer) and loop is not None and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            coro = layer.group_send(GROUP, _message(event, data))
            if running is loop:
                loop.create_task(coro).add_done_callback(lambda f: _log_failure(f, event))
            else:
                asyncio.run_coroutine_threadsafe(coro, loop).add_done_callback(lambda f: _log_failure(f, event))
            return
        async_to_sync(layer.group_send)(GROUP, _message(event, data))
    except Exception:  # noqa: BLE001 - an event must never break the operation it reports
        log.warning("event_publish_failed", event_name=event, exc_info=True)
