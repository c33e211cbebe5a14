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
import threading
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

    lock = threading.Lock()
    gpu1: list[EmbeddedEngineClient] = []
    client = engine_client_build.EngineSet.client

    def two_engines_client(self, name: str):
        if name != "gpu1":
            return client(self, name)
        with lock:
            if not gpu1:
                gpu1.append(EmbeddedEngineClient())
            return gpu1[0]

    engine_client_build.EngineSet.client = two_engines_client  # type: ignore[method-assign]

    # GET /api/engines reads an embedded engine's status from the runtime's one engine (a
    # real embedded stack runs one: ENGINE_MODELS naming another needs REDIS_URL); gpu1's
    # live fields come from gpu1's own client here, as a Redis engine's heartbeat gives them
    from orchestration import engines as report

    engines_report = report.engines_report

    def two_engines_report():
        out = engines_report()
        with lock:
            built = gpu1[0] if gpu1 else None
        for entry in out:
            if entry["name"] == "gpu1":
                status = built.status() if built is not None else None
                ready = status is not None and status.state == "ready"
                entry.update(
                    alive=status is not None,
                    phase="serving" if status is not None else "not_started",
                    state=status.state if status is not None else None,
                    model=status.model_id if ready else None,
                )
        return out

    report.engines_report = two_engines_report
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), "serve", *sys.argv[1:]])


if __name__ == "__main__":
    main()
