"""
title: miLLM steering dial
description: Adds miLLM's steering fields (a profile, an intensity, or inline SAE features)
  to every chat request Open WebUI sends to a miLLM server's /v1.
version: 0.1.0
requirements: pydantic

An Open WebUI filter function: paste this file under Admin Panel > Functions, enable it,
and attach it to the miLLM model (or make it global). The admin sets the defaults in its
Valves; each user may turn the dial in their own UserValves. It changes nothing but the
request body: the fields are miLLM's documented /v1 extensions (docs/api-v1.md):

- ``profile``: a steering profile by name (also reachable as ``<model>@<profile>`` from
  the model menu, which /v1/models lists);
- ``steering_intensity``: 0-2 scales the profile or the inline features, "off" turns
  steering off for the request;
- ``steering``: inline features ``{"sae_id": ..., "features": [{"index", "strength"}]}``,
  written here as ``"12:4.0, 40:-2"``.

A request that already carries one of these fields keeps it (an explicit client wins).
This file imports nothing from miLLM: it runs inside Open WebUI.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

_FIELDS = ("profile", "steering", "steering_intensity")


def parse_features(text: str) -> list[dict[str, Any]]:
    """``"12:4.0, 40:-2"`` → ``[{"index": 12, "strength": 4.0}, {"index": 40, "strength": -2.0}]``."""
    out = []
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        index, sep, strength = item.partition(":")
        if not sep:
            raise ValueError(f"feature {item!r} is not index:strength")
        out.append({"index": int(index), "strength": float(strength)})
    return out


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default=0, description="Order among filters (lower runs first).")
        profile: str = Field(default="", description="Steering profile applied by default (empty: none).")
        intensity: str = Field(default="", description='Default intensity, 0-2 or "off" (empty: the server\'s 1).')
        sae_id: str = Field(default="", description="SAE of the inline features (empty: the one attached).")
        features: str = Field(default="", description='Inline features, e.g. "12:4.0, 40:-2" (empty: none).')

    class UserValves(BaseModel):
        profile: str = Field(default="", description="Your steering profile (empty: the admin's).")
        intensity: str = Field(default="", description='Your intensity, 0-2 or "off" (empty: the admin\'s).')
        features: str = Field(default="", description='Your inline features, e.g. "12:4.0" (empty: the admin\'s).')

    def __init__(self) -> None:
        self.valves = self.Valves()

    def _dial(self, user: dict[str, Any] | None) -> dict[str, Any]:
        mine = (user or {}).get("valves")
        own = lambda name: (getattr(mine, name, "") or "").strip()  # noqa: E731
        # a user who picks a profile or features replaces the admin's choice whole (the
        # server takes a profile or inline features, not both); the intensity separately
        source = "user" if own("profile") or own("features") else "admin"
        pick = own if source == "user" else (lambda name: getattr(self.valves, name).strip())
        fields: dict[str, Any] = {}
        if profile := pick("profile"):
            fields["profile"] = profile
        if features := pick("features"):
            inline: dict[str, Any] = {"features": parse_features(features)}
            if self.valves.sae_id.strip():
                inline["sae_id"] = self.valves.sae_id.strip()
            fields["steering"] = inline
        if intensity := own("intensity") or self.valves.intensity.strip():
            fields["steering_intensity"] = "off" if intensity.lower() == "off" else float(intensity)
        return fields

    def inlet(self, body: dict[str, Any], __user__: dict[str, Any] | None = None) -> dict[str, Any]:
        if any(name in body for name in _FIELDS):
            return body
        return {**body, **self._dial(__user__)}

    def outlet(self, body: dict[str, Any], __user__: dict[str, Any] | None = None) -> dict[str, Any]:
        return body
