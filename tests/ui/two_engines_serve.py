"""``manage.py serve`` with a second engine, ``gpu1``, beside the default one: its own
in-process engine (``EmbeddedEngineClient``), swapped in at the client boundary as
tests/api/test_engines.py does, and ``ENGINE_MODELS=gpu1:tiny-gpt2;default:*``. The
served front routes by model name as a stack with two engines does; the test loads the
two models through the API. (The start-up check that another engine needs REDIS_URL is for
Redis engines: this one lives in the process.)

``two_engines_serve.py ARGS``: ``manage.py serve ARGS``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROUTES = "gpu1:tiny-gpt2;default:*"


def main() -> None:
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    import django

    django.setup()
    from django.conf import settings

    settings.ENGINE_MODELS = ROUTES
    from core import engine_client_build
    from core.engine_client import EmbeddedEngineClient

    client = engine_client_build.EngineSet.client

    def two_engines_client(self, name: str):
        if name != "gpu1":
            return client(self, name)
        with self._lock:  # gpu1's client is this process's second embedded engine
            if "gpu1" not in self._clients:
                self._clients["gpu1"] = EmbeddedEngineClient()
            return self._clients["gpu1"]

    engine_client_build.EngineSet.client = two_engines_client  # type: ignore[method-assign]
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), "serve", *sys.argv[1:]])


if __name__ == "__main__":
    main()
