"""Several engines behind one front: which engine a model belongs to, and which engine the
work running now addresses.

An engine is one ``run_engine`` process with a name (``ENGINE_NAME``, ``default`` unless
set); its Redis keys live under ``engine_prefix(name)``: ``ENGINE_STREAM_PREFIX`` for the
default engine, ``<ENGINE_STREAM_PREFIX>.<name>`` for the others, so the one-engine-per-prefix
rule of ``gpu_engine.server.ownership`` is one engine per name.

The web tier's ``ENGINE_MODELS`` says which engine may hold which model
(``gpu1:model-b;default:*``): each engine lists model names or ``fnmatch`` patterns, and a
model belongs to the first engine that names it exactly, else the first whose pattern
matches it. Unset, there is one engine, ``default``, which may hold every model: today's
single-engine behaviour, unchanged.

Routing is a context: ``using_engine(name)`` makes ``core.runtime.runtime().engine`` the
client of that engine for the code it wraps (threads started with a copied context and
``asyncio.to_thread`` carry it), so the services and views that reach "the engine" reach
the model's engine without passing a client around. Outside such a context,
``runtime().engine`` is the default engine's client.
"""

from __future__ import annotations

import contextvars
import fnmatch
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from core.errors import MillmError

DEFAULT_ENGINE = "default"

_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("millm_engine", default=None)


class ModelNotRoutable(MillmError):
    """A registered model that no engine of ENGINE_MODELS may hold."""

    code, status = "MODEL_NOT_ROUTABLE", 409


@dataclass(frozen=True)
class EngineRoute:
    name: str
    patterns: tuple[str, ...]  # model names or fnmatch patterns; "*" is every model


def valid_engine_name(name: str) -> bool:
    return bool(name) and len(name) <= 40 and all(c.isalnum() or c in "_-" for c in name)


def parse_engine_models(value: str) -> tuple[EngineRoute, ...]:
    """``ENGINE_MODELS``'s routes, in order; ValueError saying what is wrong. Empty: the one
    default engine holding every model."""
    value = (value or "").strip()
    if not value:
        return (EngineRoute(DEFAULT_ENGINE, ("*",)),)
    routes: list[EngineRoute] = []
    seen: set[str] = set()
    for part in value.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, models = part.partition(":")
        name = name.strip()
        if not sep:
            raise ValueError(f"{part!r} is not engine:model,model (e.g. gpu1:model-b;default:*)")
        if not valid_engine_name(name):
            raise ValueError(f"engine name {name!r} must be 1-40 letters, digits, _ or -")
        if name in seen:
            raise ValueError(f"engine {name!r} is listed twice")
        seen.add(name)
        patterns = tuple(p.strip() for p in models.split(",") if p.strip())
        if not patterns:
            raise ValueError(f"engine {name!r} lists no model")
        routes.append(EngineRoute(name, patterns))
    if not routes:
        raise ValueError("lists no engine")
    return tuple(routes)


def _routes() -> tuple[EngineRoute, ...]:
    from django.conf import settings

    return _parsed(getattr(settings, "ENGINE_MODELS", ""))


@functools.lru_cache(maxsize=8)
def _parsed(value: str) -> tuple[EngineRoute, ...]:
    # every /v1 request asks (several_engines); the value is parsed once per value seen
    return parse_engine_models(value)


def engine_names() -> list[str]:
    """The engines this front routes to, in ENGINE_MODELS's order."""
    return [r.name for r in _routes()]


def primary_engine() -> str:
    """The engine the one-engine fields of the health routes and ``/api/models``'
    ``loaded_model_id`` describe: ``default`` when ENGINE_MODELS lists it, else its first."""
    names = engine_names()
    return DEFAULT_ENGINE if DEFAULT_ENGINE in names else names[0]


def several_engines() -> bool:
    routes = _routes()
    return len(routes) > 1 or routes[0].name != DEFAULT_ENGINE


def engine_patterns(name: str) -> tuple[str, ...]:
    return next((r.patterns for r in _routes() if r.name == name), ())


def engine_for_model(model_name: str) -> str | None:
    """The engine ``model_name`` belongs to: the first that names it exactly, else the
    first whose pattern matches; None when no engine may hold it."""
    routes = _routes()
    for route in routes:
        if model_name in route.patterns:
            return route.name
    for route in routes:
        if any(fnmatch.fnmatchcase(model_name, p) for p in route.patterns):
            return route.name
    return None


def route_model(model_name: str) -> str:
    """``engine_for_model``, or ModelNotRoutable (409 ``model_not_routable``)."""
    name = engine_for_model(model_name)
    if name is None:
        raise ModelNotRoutable(
            f"No engine may hold model {model_name!r}: ENGINE_MODELS lists it for none of {', '.join(engine_names())}",
            details={"model": model_name, "engines": engine_names()},
        )
    return name


def engine_prefix(name: str, base: str | None = None) -> str:
    """The Redis prefix of engine ``name``: ``ENGINE_STREAM_PREFIX`` for the default one."""
    if base is None:
        from django.conf import settings

        base = settings.ENGINE_STREAM_PREFIX
    return base if name == DEFAULT_ENGINE else f"{base}.{name}"


def current_engine() -> str:
    """The engine the running code addresses (``using_engine``), else the default one."""
    return _CURRENT.get() or DEFAULT_ENGINE


def selected_engine() -> str | None:
    """The engine ``using_engine`` selected, None outside one (``core.runtime`` asks)."""
    return _CURRENT.get()


@contextmanager
def using_engine(name: str) -> Iterator[str]:
    """Address engine ``name`` for the code this wraps."""
    token = _CURRENT.set(name)
    try:
        yield name
    finally:
        _CURRENT.reset(token)


@contextmanager
def using_model_engine(model_name: str) -> Iterator[str]:
    """Address the engine ``model_name`` belongs to (ModelNotRoutable when none may hold
    it). With one engine this selects nothing: the default client, as before."""
    if not several_engines():
        yield DEFAULT_ENGINE
        return
    with using_engine(route_model(model_name)) as name:
        yield name


__all__ = [
    "DEFAULT_ENGINE",
    "EngineRoute",
    "ModelNotRoutable",
    "current_engine",
    "engine_for_model",
    "engine_names",
    "engine_patterns",
    "engine_prefix",
    "parse_engine_models",
    "primary_engine",
    "route_model",
    "selected_engine",
    "several_engines",
    "using_engine",
    "using_model_engine",
]
