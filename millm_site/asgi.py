"""ASGI entry point: HTTP through Django, WebSockets through Channels."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from millm_site.auth import WebSocketApiKeyMiddleware  # noqa: E402
from millm_site.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter({
    "http": django_asgi_app,
    "websocket": WebSocketApiKeyMiddleware(URLRouter(websocket_urlpatterns)),
})
