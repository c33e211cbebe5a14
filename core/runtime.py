"""The process's runtime: the long-lived objects that every layer reaches — the engine
client, the admission controller, residency, the metrics push, the analyzers — held by one object
instead of module globals.

Each part is built once, on first use, from a builder the site installs when Django is
ready (``millm_site.apps``): the site is the one layer that may import every app, so it
decides what an embedded or a distributed process is made of, and no app builds another
app's objects. Building on first use keeps ``manage.py migrate`` from starting an engine.

Tests replace parts through ``runtime().replaced(engine=..., admission=...)`` (the
``runtime_parts`` fixture wraps it); nothing else swaps them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from core.engines import DEFAULT_ENGINE, selected_engine

if TYPE_CHECKING:  # the types only: the web tier never imports the engine
    from core.engine_client import EngineClient

PARTS = ("engine", "engines", "admission", "residency", "metrics_push", "events", "jobs", "hub", "analyzers")


class Runtime:
    engine: EngineClient  # the engine the running code addresses (core.engines.using_engine)
    engines: Any  # core.engine_client_build.EngineSet: every engine's client by name
    admission: Any  # inference.admission.AdmissionController or its shared twin
    residency: Any  # inference.residency.Residency
    metrics_push: Any  # system.metrics.MetricsPush
    events: Any  # core.events.EventBus
    jobs: Any  # core.jobs.JobDispatch
    hub: Any  # registry.hub.HubBreakers
    analyzers: Any  # monitoring.analysis.Analyzers

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._builders: dict[str, Callable[[], Any]] = {}
        self._built: dict[str, Any] = {}

    def install(self, **builders: Callable[[], Any]) -> None:
        """Declare how each part is built (the site does this once, at start)."""
        unknown = set(builders) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown runtime parts: {sorted(unknown)}")
        with self._lock:
            self._builders.update(builders)

    def __getattr__(self, name: str) -> Any:
        if name not in PARTS:
            raise AttributeError(name)
        if name == "engine":
            selected = selected_engine()
            if selected is not None and selected != DEFAULT_ENGINE:
                return self.__getattr__("engines").client(selected)
        with self._lock:
            part = self._built.get(name)
            if part is None:
                builder = self._builders.get(name)
                if builder is None:
                    raise RuntimeError(f"the runtime has no builder for {name!r}: is 'millm_site' in INSTALLED_APPS?")
                part = self._built[name] = builder()
            return part

    def built(self, name: str) -> Any | None:
        """The part if it exists already (health must not start an engine to report)."""
        with self._lock:
            return self._built.get(name)

    @contextmanager
    def replaced(self, **parts: Any) -> Iterator[Runtime]:
        """Use ``parts`` for the duration (tests); the previous ones come back after."""
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown runtime parts: {sorted(unknown)}")
        with self._lock:
            saved = {name: self._built.get(name) for name in parts}
            self._built.update(parts)
        try:
            yield self
        finally:
            with self._lock:
                for name, part in saved.items():
                    if part is None:
                        self._built.pop(name, None)
                    else:
                        self._built[name] = part

    def shutdown(self) -> None:
        """Release what was built (process exit, tests)."""
        with self._lock:
            built, self._built = self._built, {}
        for name in reversed(PARTS):
            part = built.get(name)
            for method in ("shutdown", "close"):
                if part is not None and hasattr(part, method):
                    getattr(part, method)()
                    break


_runtime = Runtime()


def runtime() -> Runtime:
    return _runtime
