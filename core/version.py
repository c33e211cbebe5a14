"""The server's version (pyproject.toml's), for /api/health/version and /v1's
``system_fingerprint``."""

from __future__ import annotations

import tomllib
from functools import cache

from django.conf import settings


@cache
def version() -> str:
    try:
        with open(settings.BASE_DIR / "pyproject.toml", "rb") as fh:
            return str(tomllib.load(fh)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
