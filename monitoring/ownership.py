"""Who owns what monitoring keeps (issue 31, item 10; docs/security.md): captures, probes
and the monitoring history (activation records, probe verdicts) belong to the principal
that made them (``core.auth.Principal.owner``: ``anonymous`` with keys off, else
``key:<label>``). An inference key lists and reads only its own (another key's object is a
404, as if it did not exist); an admin key, and everyone when keys are off, sees all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from core.auth import principal

ANONYMOUS = "anonymous"
OWNER_MAX_CHARS = 80  # "anonymous" or "key:<label>" (core.auth: labels up to 64)


@dataclass(frozen=True)
class Scope:
    """What one caller may see: ``owner`` names what it makes; ``all`` (an admin, or keys
    off) sees every owner's objects."""

    owner: str = ANONYMOUS
    all: bool = True

    @classmethod
    def of(cls, principal: Any) -> Scope:
        return cls(owner=principal.owner, all=bool(principal.admin))

    @classmethod
    def of_request(cls, request: Any) -> Scope:
        return cls.of(principal(request))

    def filter(self, qs: QuerySet) -> QuerySet:
        return qs if self.all else qs.filter(owner=self.owner)


# a process's own work (management commands, the engine's jobs): every object
EVERYONE = Scope()
