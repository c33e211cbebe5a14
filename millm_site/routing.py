from django.urls import path

from millm_site.consumers import EventsConsumer

websocket_urlpatterns = [
    path("ws/events", EventsConsumer.as_asgi()),
]
