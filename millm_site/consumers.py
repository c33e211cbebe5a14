"""WebSocket consumer for ``/ws/events``: joins the event group and relays each event."""

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from millm_site.events import GROUP


class EventsConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def millm_event(self, message: dict) -> None:
        await self.send_json({"event": message["event"], "data": message["data"]})
