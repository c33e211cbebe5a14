from django.urls import path, re_path

from millm_site.consumers import EventsConsumer, NoSuchSocket

websocket_urlpatterns = [
    path("ws/events", EventsConsumer.as_asgi()),
    re_path(r"", NoSuchSocket.as_asgi()),  # any other path: refused, not a server error
]
