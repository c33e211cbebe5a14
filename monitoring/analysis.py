"""Analyzers on the server (issue 15): the registry a deployment extends
(``ANALYZERS_EXTRA``), probe files named inside ``ANALYZER_PROBE_DIR``, and the bounded
pool that runs analyses off the event loop and off the engine's decode loop.

Where analyses run, and why not Celery: a /v1 request answers with its analyses in the
same response, so the web process that holds the response runs them, on a small thread
pool of its own (``ANALYSIS_WORKERS``), after the generation has finished and the engine
has moved on. A Celery ``analysis`` queue would need a result backend to wait on, which
this deployment does not have, and would ship the capture to a worker only to ship the
numbers back; an analysis is numpy over one request's capture (milliseconds). The same
pool serves ``/api/captures/{id}/analyze``.

The math lives in ``gpu_engine.analysis`` (no Django, no torch); this module only names,
prepares, arms and runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import close_old_connections, connections

from core.errors import MillmError, from_engine_error
from gpu_engine.analysis import (
    AnalysisContext,
    AnalyzerRegistry,
    CaptureNeed,
    check_capture,
    default_registry,
    load_extra,
)
from gpu_engine.errors import AnalyzerCaptureMissing, EngineError

log = structlog.get_logger(__name__)

# analyses running at once in one web process; more wait in the pool's queue (each is
# bounded by its capture, itself bounded by CAPTURE_MAX_BYTES)
ANALYSIS_WORKERS = 2
# the longest a synchronous caller (/api/captures/{id}/analyze) waits for one analysis
ANALYSIS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PreparedAnalysis:
    """One ``analyze`` entry whose params the analyzer accepted (probe files loaded)."""

    name: str
    analyzer: Any
    prepared: Any
    need: CaptureNeed


def _load_stored(capture_id: str) -> Any:
    """A stored capture by id (CoRe's N/A run): only ever a file of a ``Capture`` row."""
    from gpu_engine.artifacts import load_capture
    from monitoring.selectors import capture_file

    return load_capture(capture_file(capture_id=capture_id))


def _error_entry(name: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, EngineError):
        return {"name": name, "error": {"code": exc.code, "message": exc.message}}
    if isinstance(exc, MillmError):
        return {"name": name, "error": {"code": exc.code.lower(), "message": exc.message}}
    log.error("analysis_failed", analyzer=name, error_type=type(exc).__name__,
              exc_info=(type(exc), exc, exc.__traceback__))
    return {"name": name, "error": {"code": "analysis_failed",
                                    "message": f"analyzer {name!r} failed on this capture"}}


class Analyzers:
    """The process's analyzer registry and pool (a runtime part: ``runtime().analyzers``)."""

    def __init__(self, registry: AnalyzerRegistry, probe_dir: str | Path,
                 workers: int = ANALYSIS_WORKERS) -> None:
        self.registry = registry
        self.probe_dir = Path(probe_dir)
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="millm-analysis")

    @classmethod
    def from_settings(cls) -> Analyzers:
        """The built-in analyzers plus ``ANALYZERS_EXTRA``'s (``ValueError`` naming a bad
        entry: the site stops start-up on it)."""
        registry = default_registry()
        load_extra(registry, settings.ANALYZERS_EXTRA)
        return cls(registry, settings.ANALYZER_PROBE_DIR)

    def context(self) -> AnalysisContext:
        return AnalysisContext(probe_dir=self.probe_dir, load_capture=_load_stored)

    # ------------------------------------------------------------------ preparing

    def prepare(self, asked: Iterable[tuple[str, dict[str, Any]]]) -> list[PreparedAnalysis]:
        """Each analyzer by name with its params validated (probe files read): raises
        ``UnknownAnalyzer`` (listing the known names), ``InvalidParameter`` or
        ``InvalidProbeFile`` before anything runs."""
        ctx = self.context()
        out = []
        for name, params in asked:
            analyzer = self.registry.get(name)
            prepared = analyzer.prepare(dict(params), ctx)
            out.append(PreparedAnalysis(name, analyzer, prepared, analyzer.needs(prepared)))
        return out

    async def aprepare(self, asked: Iterable[tuple[str, dict[str, Any]]]
                       ) -> list[PreparedAnalysis]:
        return await self._submit(self.prepare, list(asked))

    @staticmethod
    def need(analyses: list[PreparedAnalysis]) -> CaptureNeed:
        need = CaptureNeed()
        for a in analyses:
            need = need.merged(a.need)
        return need

    # ------------------------------------------------------------------ running

    def run(self, analyses: list[PreparedAnalysis], source: bytes | Path | None, *,
            strict: bool = False) -> list[dict[str, Any]]:
        """Every analysis on one capture (its bytes or its file): ``[{name, result}]``.
        A failure on this capture (a span past the prompt, a probe of another width) is
        that entry's ``error`` — the generation has been answered already — unless
        ``strict``, where it raises (``/api/captures/{id}/analyze``)."""
        from gpu_engine.artifacts import load_capture

        ctx = self.context()
        try:
            capture = load_capture(source) if source is not None else None
        except (OSError, ValueError) as exc:
            if strict:
                raise
            return [_error_entry(a.name, exc) for a in analyses]
        out: list[dict[str, Any]] = []
        for a in analyses:
            try:
                if capture is None:
                    raise AnalyzerCaptureMissing(f"analyzer {a.name!r} got no capture",
                                                 details={"param": "analyze"})
                check_capture(capture.meta, a.need, a.name)
                out.append({"name": a.name, "result": a.analyzer.run(capture, a.prepared, ctx)})
            except Exception as exc:  # noqa: BLE001 - one analyzer's failure is its entry
                if strict:
                    raise
                out.append(_error_entry(a.name, exc))
        return out

    async def arun(self, analyses: list[PreparedAnalysis], source: bytes | Path | None
                   ) -> list[dict[str, Any]]:
        return await self._submit(self.run, analyses, source)

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool, awaited (hidden-state probes on a capture)."""
        return await self._submit(fn, *args)

    def run_wait(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool, waited for (synchronous callers)."""
        return self._pool.submit(self._in_pool, fn, *args).result(timeout=ANALYSIS_TIMEOUT_S)

    async def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._pool.submit(self._in_pool, fn, *args))

    @staticmethod
    def _in_pool(fn: Callable[..., Any], *args: Any) -> Any:
        # CoRe's N/A run reads a Capture row: the pool thread's connection is checked as a
        # request's would be, and closed after, so no idle connection outlives the task
        close_old_connections()
        try:
            return fn(*args)
        finally:
            connections.close_all()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def analysis_check_backend(*, need: CaptureNeed, capabilities: dict[str, Any],
                           backend: str, analyzers: list[str]) -> None:
    """Refuse, before generation, analyzers whose capture the loaded backend cannot take
    (vLLM and llama.cpp report neither capture capability today)."""
    if not capabilities:
        return  # nothing reported: the engine refuses the capture itself
    wants = []
    if need.layers:
        wants.append(("hidden_state_capture", "hidden states"))
    if need.qk_layers:
        wants.append(("attention_capture", "attention Q/K"))
    for capability, what in wants:
        if not capabilities.get(capability, False):
            names = ", ".join(repr(n) for n in analyzers)
            raise AnalyzerCaptureMissing(
                f"analyzer {names} reads {what}, which the {backend} backend cannot capture "
                f"({capability} is off)",
                details={"param": "analyze", "backend": backend, "capability": capability,
                         "analyzers": analyzers})


def capture_analyze(*, capture_id: str, name: str, params: dict[str, Any],
                    analyzers: Analyzers) -> dict[str, Any]:
    """Run analyzer ``name`` on a stored capture: ``CAPTURE_NOT_FOUND`` for an id that is
    not a stored capture, ``ANALYZER_CAPTURE_MISSING`` when the capture lacks what the
    analyzer reads, the analyzer's own refusals otherwise."""
    from monitoring.selectors import capture_file

    path = capture_file(capture_id=capture_id)  # CaptureNotFound; never outside CAPTURE_DIR
    try:
        prepared = analyzers.run_wait(analyzers.prepare, [(name, params)])
        (entry,) = analyzers.run_wait(lambda: analyzers.run(prepared, path, strict=True))
    except EngineError as exc:  # one engine table for every surface
        raise from_engine_error(exc) from None
    return {"capture_id": capture_id, "name": name, "result": entry["result"]}


__all__ = ["ANALYSIS_WORKERS", "Analyzers", "PreparedAnalysis", "analysis_check_backend",
           "capture_analyze"]
