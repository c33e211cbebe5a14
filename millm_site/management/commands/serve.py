"""Run the ASGI server (daphne) on HOST:PORT from the configuration.

Before serving (``orchestration.startup.application_start``, which the ASGI module also
runs, so a server started otherwise does the same): rows a previous process left mid-way
are reconciled, in embedded mode the recorded model and SAEs are restored, and
AUTO_LOAD_MODEL starts loading in the background (readiness answers 503 until it is
resident). Without
MILLM_API_KEYS the server is unauthenticated, so unless HOST is set explicitly it binds to
127.0.0.1 only, and says so.
"""

import socket

import structlog
from daphne.cli import CommandLineInterface
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.auth import keys_enabled
from core.errors import MillmError

log = structlog.get_logger("millm.serve")


def bind_host(explicit: str | None = None) -> tuple[str, str]:
    """(host, note): the address to bind and what to tell the operator about access."""
    if explicit:
        host = explicit
    elif keys_enabled() or settings.MILLM_HOST_EXPLICIT:
        host = settings.MILLM_HOST
    else:
        host = "127.0.0.1"
    if keys_enabled():
        note = (
            f"API keys required on /api, /v1 and /ws/events "
            f"({len(settings.MILLM_API_KEYS)} inference key(s), "
            f"{len(settings.MILLM_ADMIN_API_KEYS)} admin key(s) configured)"
        )
    elif host in ("127.0.0.1", "localhost", "::1"):
        note = (
            "no MILLM_API_KEYS: authentication is off, so the server listens on "
            f"{host} only (set MILLM_API_KEYS, or HOST explicitly, to listen elsewhere)"
        )
    else:
        note = f"WARNING: no MILLM_API_KEYS and HOST={host}: /api and /v1 are open to anyone who can reach this address"
    return host, note


def ensure_bindable(host: str, port: int) -> None:
    """Refuse, in one line, a HOST:PORT daphne could not listen on, before anything starts.

    The start-up loads AUTO_LOAD_MODEL in a background thread; were daphne to find the port
    taken only after that, the process would exit mid-load and leave the model's row
    failed. The probe binds as Twisted does (SO_REUSEADDR), so a port in TIME_WAIT passes
    and one another server listens on does not.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CommandError(f"HOST={host}: cannot resolve it ({exc.strerror})") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


class Command(BaseCommand):
    help = "Serve HTTP and WebSockets with daphne on the configured HOST and PORT."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=None)
        parser.add_argument("--port", type=int, default=None)
        parser.add_argument("--no-auto-load", action="store_true", help="Do not load AUTO_LOAD_MODEL at start-up.")

    def handle(self, *args, host: str | None, port: int | None, no_auto_load: bool, **options):
        from orchestration import startup

        host, access = bind_host(host)
        port = port or settings.MILLM_PORT
        mode = "embedded" if settings.EMBEDDED else "distributed"
        ensure_bindable(host, port)
        try:
            startup.application_start(auto_load_model=not no_auto_load)
        except MillmError as exc:
            setting = (exc.details or {}).get("setting")
            shown = setting or f"AUTO_LOAD_MODEL={settings.AUTO_LOAD_MODEL}"
            raise CommandError(f"{shown}: {exc.code}: {exc.message}") from exc
        log.info(
            "serving",
            host=host,
            port=port,
            mode=mode,
            access=access,
            database=settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
        )
        self.stdout.write(
            f"miLLM listening on http://{host}:{port}/ ({mode} mode); admin at /admin/, API docs at /api/docs"
        )
        self.stdout.write(f"Access: {access}")
        self.stdout.flush()
        try:
            # no --proxy-headers: forwarded headers are believed only from TRUSTED_PROXIES,
            # which millm_site.boundary checks against the connection's own peer
            from millm_site.daphne_guard import install

            install()  # bodies refused before daphne reads them (millm_site.daphne_guard)
            CommandLineInterface().run(["-b", host, "-p", str(port), "millm_site.asgi:application"])
        finally:
            # daphne has stopped (SIGTERM, SIGINT): the engine and the pools go down with
            # the server, the vLLM backend's engine-core process included (left running, it
            # kept the interpreter waiting on it at exit for good)
            from core.runtime import runtime

            runtime().shutdown()
