"""Who is acting: the caller of the request being served, kept in a context variable.

``AuditActorMiddleware`` puts the request there (after the key check and the admin's
session login, which identify the caller); ``current_actor`` works out the name only when
an entry is written, on the thread that writes it (the admin user is a lazy database
read). Outside a request (Celery, the sweeper, start-up, ``manage.py``) the actor is
``system`` unless ``acting_as`` names one. Threads started for a request carry it only
when they run in a copy of its context (``contextvars.copy_context().run``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from asgiref.sync import iscoroutinefunction

from core.auth import principal
from core.middleware import LoopMiddleware

# the request being served, or an explicit (actor, kind) pair
_CALLER: ContextVar[Any] = ContextVar("millm_audit_caller", default=None)

ANONYMOUS = ("anonymous", "anonymous")
SYSTEM = ("system", "system")


def actor_of(request: Any) -> tuple[str, str]:
    """(name, kind) of a request's caller: the Django admin user on the admin site, else
    the key's label (``anonymous`` with keys off)."""
    path = getattr(request, "path_info", "") or ""
    if path.startswith("/admin"):
        user = getattr(request, "user", None)
        if user is not None and getattr(user, "is_authenticated", False):
            return user.get_username()[:150], "admin_user"
    who = principal(request)
    if who.owner == "anonymous":
        return ANONYMOUS
    return who.label, "admin_key" if who.admin else "inference_key"


def current_actor() -> tuple[str, str]:
    holder = _CALLER.get()
    if holder is None:
        return SYSTEM
    if isinstance(holder, tuple):
        return holder
    try:
        return actor_of(holder)
    except Exception:  # noqa: BLE001 - naming the actor must never break the action
        return ("unknown", "system")


@contextmanager
def acting_as(actor: str, kind: str) -> Iterator[None]:
    """Record what runs inside as ``actor`` (e.g. an admin user in a management action)."""
    token = _CALLER.set((actor, kind))
    try:
        yield
    finally:
        _CALLER.reset(token)


class AuditActorMiddleware(LoopMiddleware):
    """Keeps the request as the acting caller while its view runs. Runs on the event loop
    (no thread hop, no database: the name is worked out only when an entry is written)."""

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        token = _CALLER.set(request)
        try:
            return self.get_response(request)
        finally:
            _CALLER.reset(token)

    async def __acall__(self, request):
        token = _CALLER.set(request)
        try:
            return await self.get_response(request)
        finally:
            _CALLER.reset(token)
