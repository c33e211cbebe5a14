"""``KEY_LIMITS``: the per-key limits of /v1 (docs/configuration.md, "Quotas and usage"),
parsed and checked at start-up. Pure Python (no Django): ``millm_site.config`` checks the
setting with it before anything else runs, and ``inference.quotas`` reads the result.

The value is a JSON object keyed by key label (``core.auth``: the ``label`` of
``label:secret``) and ``*`` (every inference key), each entry ``{"rpm", "tpm",
"concurrent"}`` (positive integers; ``null`` lifts a limit the ``*`` entry sets). A key's
own entry overrides the ``*`` entry field by field. Admin keys are limited only by an
entry that names them (the ``*`` entry never applies to them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FIELDS = ("rpm", "tpm", "concurrent")
DEFAULT = "*"
# a limit past this is a typo, not a quota (and keeps Redis' integers far from overflow)
MAX_LIMIT = 10**12
_LABEL = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


@dataclass(frozen=True)
class Limits:
    """One key's limits; ``None``: not limited."""

    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None

    @property
    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.concurrent is not None


NONE = Limits()


class KeyLimitsError(ValueError):
    """What is wrong with ``KEY_LIMITS``, in one line (``millm_site.config`` names the setting)."""


def _entry(label: str, raw: Any) -> dict[str, int | None]:
    if not isinstance(raw, dict):
        raise KeyLimitsError(f'the entry of {label!r} must be an object like {{"rpm": 60}}')
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise KeyLimitsError(f"the entry of {label!r} has unknown fields {unknown}; allowed: {', '.join(FIELDS)}")
    out: dict[str, int | None] = {}
    for name, value in raw.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT):
            raise KeyLimitsError(
                f"{label}.{name} must be a whole number from 1 to {MAX_LIMIT} or null (no limit), got {value!r}"
            )
        out[name] = value
    return out


def parse_key_limits(text: str) -> dict[str, dict[str, int | None]]:
    """The setting's entries (label -> the fields it sets); ``{}`` for an empty value.
    Raises ``KeyLimitsError`` naming what is wrong."""
    text = (text or "").strip()
    if not text:
        return {}
    if len(text) > 1_000_000:
        raise KeyLimitsError("is longer than 1,000,000 characters")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise KeyLimitsError(f'must be a JSON object like {{"*": {{"rpm": 60}}}}: {exc}') from None
    if not isinstance(data, dict):
        raise KeyLimitsError('must be a JSON object like {"*": {"rpm": 60, "tpm": 100000, "concurrent": 4}}')
    out = {}
    for label, raw in data.items():
        if label != DEFAULT and not _LABEL.fullmatch(label):
            raise KeyLimitsError(f"{label!r} is neither '*' nor a key label (letters, digits, _ . @ -, at most 64)")
        out[label] = _entry(label, raw)
    return out


def limits_for(table: dict[str, dict[str, int | None]], label: str, *, admin: bool) -> Limits:
    """The limits of the key ``label``: its own entry over the ``*`` entry; an admin key
    only its own entry."""
    own = table.get(label)
    if admin and own is None:
        return NONE
    merged = {} if admin else dict(table.get(DEFAULT) or {})
    merged.update(own or {})
    return Limits(**{name: merged.get(name) for name in FIELDS})
