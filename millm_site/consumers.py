"""WebSocket consumer for ``/ws/events``: joins the event group and relays each event,
and while connected receives this process's ``system:metrics`` (``MetricsPush``).

Authentication happens before the consumer (``core.auth.WebSocketApiKeyMiddleware``),
which puts the caller's principal in the scope: an event about one owner's objects goes to
that owner's sockets and admin sockets only.
The socket only sends; anything a client writes is ignored.
"""

import asyncio

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from core import events
from core.auth import ANONYMOUS
from core.events import GROUP, OWNER_FIELD
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
        data = message["data"]
        if isinstance(data, dict) and OWNER_FIELD in data:
            who = self.scope.get("millm_principal") or ANONYMOUS
            if not who.admin and who.owner != data[OWNER_FIELD]:
                return  # another key's batch or request: not this socket's to see
            data = {k: v for k, v in data.items() if k != OWNER_FIELD}
        await self.send_json({"event": message["event"], "data": data})


class NoSuchSocket(AsyncJsonWebsocketConsumer):
    """A WebSocket path with no route: the handshake is refused with close code 4404
    (Channels' router would raise, which the server answers as a 500 with a traceback)."""

    async def connect(self) -> None:
        await self.close(code=4404)
