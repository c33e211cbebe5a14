"""
title: miLLM steering dial
description: Adds miLLM's steering fields (a profile, an intensity, or inline SAE features)
  to every chat request Open WebUI sends to a miLLM server's /v1.
version: 0.2.0
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

The server takes a profile or inline features, never both, so the filter sends at most
one of them, decided in this order:

1. a request that already carries ``profile``, ``steering`` or ``steering_intensity`` is
   left as it is (an explicit client wins);
2. a model picked from the menu as ``<model>@<profile>`` (any model id with an ``@``
   between two non-empty parts, split at the last ``@`` as the server does) has chosen
   its profile: the filter adds no profile or features, only the intensity;
3. otherwise the user's own choice, when they set a profile or features, replaces the
   admin's whole; within one set of valves a profile wins over features (features apply
   only while the profile is empty).

The intensity (the user's, else the admin's) applies in cases 2 and 3. A valve that does
not parse (features not ``index:strength``, a strength or intensity that is not a finite
number, an intensity outside 0-2) raises ValueError, which Open WebUI shows the user,
rather than sending a request the server refuses. This file imports nothing from miLLM:
it runs inside Open WebUI.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

_FIELDS = ("profile", "steering", "steering_intensity")
MAX_INTENSITY = 2.0


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not math.isfinite(value):  # float() reads "nan" and "inf", which JSON cannot carry
        raise ValueError(f"{what} {text!r} is not a finite number")
    return value


def parse_features(text: str) -> list[dict[str, Any]]:
    """``"12:4.0, 40:-2"`` → ``[{"index": 12, "strength": 4.0}, {"index": 40, "strength": -2.0}]``."""
    out = []
    for item in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        index, sep, strength = item.partition(":")
        if not sep:
            raise ValueError(f"feature {item!r} is not index:strength")
        if not index.strip().isascii() or not index.strip().isdecimal():
            raise ValueError(f"feature {item!r}: the index is not a whole number >= 0")
        out.append({"index": int(index), "strength": _number(strength.strip(), f"feature {item!r}: strength")})
    return out


def parse_intensity(text: str) -> float | str:
    """``"off"`` or a number in [0, 2]."""
    if text.strip().lower() == "off":
        return "off"
    value = _number(text.strip(), "intensity")
    if not 0 <= value <= MAX_INTENSITY:
        raise ValueError(f'intensity {text!r} is not in 0-{MAX_INTENSITY:g} or "off"')
    return value


def menu_profile(model: Any) -> str | None:
    """The profile a ``<model>@<profile>`` pick from the model menu names, else None."""
    if not isinstance(model, str) or "@" not in model:
        return None
    base, _, profile = model.rpartition("@")
    return profile if base and profile else None


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default=0, description="Order among filters (lower runs first).")
        profile: str = Field(
            default="",
            description=(
                "Steering profile applied by default (empty: none). Wins over features when "
                "both are set; a model picked as <model>@<profile> keeps its own profile."
            ),
        )
        intensity: str = Field(
            default="",
            description=(
                'Default intensity, 0-2 or "off" (empty: the server\'s 1); it also scales a '
                "profile picked from the model menu."
            ),
        )
        sae_id: str = Field(default="", description="SAE of the inline features (empty: the one attached).")
        features: str = Field(
            default="",
            description=(
                'Inline features, e.g. "12:4.0, 40:-2", used only while profile is empty and '
                "no <model>@<profile> is picked (empty: none)."
            ),
        )

    class UserValves(BaseModel):
        profile: str = Field(
            default="",
            description=(
                "Your steering profile (empty: the admin's); replaces the admin's choice and "
                "wins over your features. A model picked as <model>@<profile> keeps its own."
            ),
        )
        intensity: str = Field(
            default="",
            description=(
                'Your intensity, 0-2 or "off" (empty: the admin\'s); also scales a profile picked from the model menu.'
            ),
        )
        features: str = Field(
            default="",
            description=(
                'Your inline features, e.g. "12:4.0"; replace the admin\'s choice, used only '
                "while your profile is empty (empty: the admin's)."
            ),
        )

    def __init__(self) -> None:
        self.valves = self.Valves()

    def _dial(self, user: dict[str, Any] | None, *, menu: bool = False) -> dict[str, Any]:
        mine = (user or {}).get("valves")
        own = lambda name: (getattr(mine, name, "") or "").strip()  # noqa: E731
        admin = lambda name: (getattr(self.valves, name) or "").strip()  # noqa: E731
        fields: dict[str, Any] = {}
        if not menu:
            # a user who picks a profile or features replaces the admin's choice whole;
            # within one set a profile wins (the server takes one of them, not both)
            pick = own if own("profile") or own("features") else admin
            if profile := pick("profile"):
                fields["profile"] = profile
            elif features := pick("features"):
                inline: dict[str, Any] = {"features": parse_features(features)}
                if sae_id := admin("sae_id"):
                    inline["sae_id"] = sae_id
                fields["steering"] = inline
        if intensity := own("intensity") or admin("intensity"):
            fields["steering_intensity"] = parse_intensity(intensity)
        return fields

    def inlet(self, body: dict[str, Any], __user__: dict[str, Any] | None = None) -> dict[str, Any]:
        if any(name in body for name in _FIELDS):
            return body
        return {**body, **self._dial(__user__, menu=menu_profile(body.get("model")) is not None)}

    def outlet(self, body: dict[str, Any], __user__: dict[str, Any] | None = None) -> dict[str, Any]:
        return body
