"""Who may ask the registry for what, beyond the key check of ``core.auth``: remote code
(ALLOW_REMOTE_CODE and an admin caller) and local paths (LOCAL_MODEL_ROOTS, admin only).
The views ask these before they call a service; the services check the operator's
settings again, so the admin site and the commands meet the same rules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from django.conf import settings

from core.auth import principal
from core.auth import require_admin as require_admin  # the views ask it here
from registry.errors import InvalidLocalPath, RemoteCodeNotAllowed


def caller_is_admin(request) -> bool:
    return principal(request).admin


def check_remote_code(*, trust_remote_code: bool, admin: bool = True) -> None:
    """Refuse ``trust_remote_code`` unless the operator enabled ALLOW_REMOTE_CODE and the
    caller holds an admin key: the repository's Python would run in the engine."""
    if not trust_remote_code:
        return
    details = {"field": "trust_remote_code", "setting": "ALLOW_REMOTE_CODE", "fields": {"trust_remote_code": []}}
    if not settings.ALLOW_REMOTE_CODE:
        message = (
            "trust_remote_code is refused: running a repository's own code is off on "
            "this server (the operator enables it with ALLOW_REMOTE_CODE=true)"
        )
    elif not admin:
        message = (
            "trust_remote_code is refused: it needs an admin key (ALLOW_REMOTE_CODE "
            "lets admins alone register remote code)"
        )
    else:
        return
    details["fields"]["trust_remote_code"] = [message]
    raise RemoteCodeNotAllowed(message, details=details)


def remote_code_enabled(trust_remote_code: bool) -> bool:
    """What a download or a load may do with a row's ``trust_remote_code`` now: a row
    registered before the operator turned ALLOW_REMOTE_CODE off runs no remote code."""
    return bool(trust_remote_code) and bool(settings.ALLOW_REMOTE_CODE)


# directories a process's own work has just written (create_demo_assets --output DIR):
# registering what it built there is the operator's decision, made on the command line
_BUILT_HERE: ContextVar[tuple[str, ...]] = ContextVar("millm_built_here", default=())


@contextmanager
def built_here(root: Path) -> Iterator[None]:
    """While it is open, ``root`` counts as a local root (never for an API request: only
    code the operator runs, around the files it has just built)."""
    token = _BUILT_HERE.set((*_BUILT_HERE.get(), str(root)))
    try:
        yield
    finally:
        _BUILT_HERE.reset(token)


def local_roots() -> list[Path]:
    """LOCAL_MODEL_ROOTS resolved; empty: the model cache, the SAE cache and the data
    directory (read at call time, so a test's own cache directories count)."""
    raw = list(settings.LOCAL_MODEL_ROOTS) or [settings.MODEL_CACHE_DIR, settings.SAE_CACHE_DIR, settings.DATA_DIR]
    raw = [*raw, *_BUILT_HERE.get()]
    roots = []
    for value in raw:
        try:
            roots.append(Path(value).expanduser().resolve())
        except (OSError, RuntimeError):
            continue
    return roots


def outside_roots(raw: str) -> InvalidLocalPath:
    """The one answer for a path outside the roots: it names the path as given, never
    what it resolves to, and is the same whether anything is there or not."""
    return InvalidLocalPath(
        "local_path must lie under one of the directories of LOCAL_MODEL_ROOTS",
        details={
            "local_path": raw,
            "setting": "LOCAL_MODEL_ROOTS",
            "fields": {"local_path": ["not under LOCAL_MODEL_ROOTS"]},
        },
    )


def check_under_roots(raw: str, path: Path) -> Path:
    """``path`` (absolute, as given) resolved, when it lies under a root; else the one
    answer of ``outside_roots``. Resolving first follows symlinks and '..', so neither
    leads out of a root; nothing about the file itself is read before the check."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        raise outside_roots(raw) from None
    for root in local_roots():
        if resolved == root or root in resolved.parents:
            return resolved
    raise outside_roots(raw)
