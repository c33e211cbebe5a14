"""Run the ASGI server (daphne) on HOST:PORT from the configuration."""

import structlog
from daphne.cli import CommandLineInterface
from django.conf import settings
from django.core.management.base import BaseCommand

log = structlog.get_logger("millm.serve")


class Command(BaseCommand):
    help = "Serve HTTP and WebSockets with daphne on the configured HOST and PORT."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=None)
        parser.add_argument("--port", type=int, default=None)

    def handle(self, *args, host: str | None, port: int | None, **options):
        host = host or settings.MILLM_HOST
        port = port or settings.MILLM_PORT
        mode = "embedded" if settings.EMBEDDED else "distributed"
        log.info("serving", host=host, port=port, mode=mode,
                 database=settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1])
        self.stdout.write(f"miLLM listening on http://{host}:{port}/ ({mode} mode); "
                          f"admin at /admin/")
        self.stdout.flush()
        CommandLineInterface().run(["-b", host, "-p", str(port), "--proxy-headers",
                                    "millm_site.asgi:application"])
