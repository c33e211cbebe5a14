"""Flags about an SAE attachment that other apps own — ``steering_enabled`` (the steering
app's live steering) and ``monitoring_enabled`` (the monitoring app's configuration) — for
the registry's attachment status, which may not import those apps. Each app registers its
provider in ``AppConfig.ready()``; a flag nobody provides reads False."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FLAGS = ("steering_enabled", "monitoring_enabled")
_providers: dict[str, Callable[[Any], bool]] = {}


def provide(flag: str, provider: Callable[[Any], bool]) -> None:
    """``provider(attachment)`` answers ``flag`` for one ``registry.Attachment`` row."""
    if flag not in FLAGS:
        raise ValueError(f"unknown attachment flag {flag!r}")
    _providers[flag] = provider


def flags(attachment: Any) -> dict[str, bool]:
    return {flag: bool(_providers[flag](attachment)) if flag in _providers else False for flag in FLAGS}
