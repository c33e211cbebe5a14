"""What the maintenance commands share: a tqdm bar fed by a download's progress callback,
the refusal of engine commands where the engine is not reachable, and error reporting."""

from __future__ import annotations

import os
from contextlib import contextmanager

from django.conf import settings
from django.core.management.base import CommandError
from tqdm import tqdm

from core.errors import MillmError


@contextmanager
def byte_bar(description: str, stream):
    bar = tqdm(
        total=None,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=description,
        file=stream,
        dynamic_ncols=True,
        mininterval=0.2,
    )

    def update(done: int, total: int | None) -> None:
        if total and bar.total != total:
            bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def token_from_env(name: str | None) -> str | None:
    """A token named by environment variable, never typed on the command line (where
    ``ps`` and the shell history would keep it)."""
    if not name:
        return None
    value = os.environ.get(name, "").strip()
    if not value:
        raise CommandError(f"--hf-token-env {name}: that environment variable is empty")
    return value


def require_engine() -> None:
    if settings.EMBEDDED:
        raise CommandError(
            "Embedded mode: the engine lives inside the `manage.py serve` process, which a "
            "separate command cannot reach. Use the API instead (POST /api/models/{id}/load, "
            "/unload, /api/saes/{id}/attach, /detach), or run the distributed topology "
            "(REDIS_URL set), where commands reach run_engine."
        )


def fail(exc: MillmError) -> CommandError:
    return CommandError(f"{exc.code}: {exc.message}")
