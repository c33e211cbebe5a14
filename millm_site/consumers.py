"""WebSocket consumer for ``/ws/events``: joins the event group and relays each event,
and while connected receives this process's ``system:metrics`` (``MetricsPush``).

Authentication happens before the consumer (``core.auth.WebSocketApiKeyMiddleware``).
The socket only sends; anything a client writes is ignored.
"""

import asyncio

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from core import events
from core.events import GROUP
from core.runtime import runtime


class EventsConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        events.bind_loop(asyncio.get_running_loop())
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()
        runtime().metrics_push.join(self.channel_name)

    async def disconnect(self, code: int) -> None:
        runtime().metrics_push.leave(self.channel_name)
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        return None

    async def millm_event(self, message: dict) -> None:
        await self.send_json({"event": message["event"], "data": message["data"]})


class NoSuchSocket(AsyncJsonWebsocketConsumer):
    """A WebSocket path with no route: the handshake is refused with close code 4404
    (Channels' router would raise, which the server answers as a 500 with a traceback)."""

    async def connect(self) -> None:
        await self.close(code=4404)
