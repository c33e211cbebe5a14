"""ASGI entry point: HTTP through Django, WebSockets through Channels.

``/v1`` gets its own Django handler with only the middlewares it uses (metrics, CORS, API
keys). Sessions, CSRF, auth, messages and the security headers serve the admin and the
browser UI; on the path every streamed token takes they only add work, and the
time-to-first-token target (SPEC §7: /v1 adds ≤ 10% over the engine) leaves no room.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

django_asgi_app = get_asgi_application()

from core.engine_client import announced  # noqa: E402 - after Django is set up
from core.runtime import runtime  # noqa: E402


class _LeanHandler(ASGIHandler):
    """Django's handler with ``settings.V1_MIDDLEWARE`` instead of ``MIDDLEWARE``."""

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler reads settings.MIDDLEWARE; it is swapped only while this handler is
        # built, once, at import.
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.V1_MIDDLEWARE
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full


v1_asgi_app = _LeanHandler()


# Generation requests are announced to the engine as they come in (core.engine_client.
# announced): a burst that reaches an idle batching engine then starts as one batch,
# instead of the first arrivals' prefill holding back the rest (docs/engine.md).
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


async def http_application(scope, receive, send):
    scope = boundary.trusted_scope(scope)
    path = boundary.routed_path(scope)
    refusal = boundary.browser_refusal(scope, path) or boundary.body_refusal(scope, path)
    if refusal is not None:
        await boundary.send_refusal(send, *refusal)
        return
    if path in GENERATION_PATHS and scope.get("method") == "POST":
        with announced(runtime().engine):
            await boundary.guarded(v1_asgi_app, scope, receive, send, path)
        return
    app = v1_asgi_app if path == "/v1" or path.startswith("/v1/") else django_asgi_app
    await boundary.guarded(app, scope, receive, send, path)


async def websocket_application(scope, receive, send):
    await _websocket(boundary.trusted_scope(scope), receive, send)


from core.auth import WebSocketApiKeyMiddleware  # noqa: E402
from millm_site import boundary  # noqa: E402
from millm_site.routing import websocket_urlpatterns  # noqa: E402

_websocket = WebSocketApiKeyMiddleware(URLRouter(websocket_urlpatterns))

application = ProtocolTypeRouter(
    {
        "http": http_application,
        "websocket": websocket_application,
    }
)

# Whatever server runs this module (manage.py serve, daphne, uvicorn), the registry is put
# right before the first request: reconciled, in embedded mode what it records as resident
# loaded into this process's engine again, and AUTO_LOAD_MODEL started. Once per process;
# the test suite turns it off (its own fixtures say what is resident).
if settings.MILLM_APPLICATION_START:
    from orchestration.startup import application_start

    application_start()
    from monitoring.pruner import pruner_start

    pruner_start()  # expired captures leave the disk with nobody running a command
    if settings.EMBEDDED:
        # this process was the only batch runner there is: take its batches back now
        # (distributed: a starting Celery worker does, batches/tasks.py)
        from batches.runner import batches_resume
        from batches.sweeper import sweeper_start

        batches_resume(force=True)
        from inference.responses_store import responses_resume

        responses_resume(force=True)  # background responses too (POST /v1/responses)
        from features.services import dashboards_resume

        dashboards_resume(force=True)  # feature dashboard runs, from their last checkpoint
        from features.sweeper import sweeper_start as dashboards_sweeper_start

        dashboards_sweeper_start()  # a run whose runner's task ended without ending it
        from experiments.services import experiments_resume
        from experiments.sweeper import sweeper_start as experiments_sweeper_start

        experiments_resume(force=True)  # sweeps and calibrations, from the points they stored
        experiments_sweeper_start()
        sweeper_start()  # a batch whose runner died, or past its window, still ends
