"""Analyzers on the server (issue 15): the registry a deployment extends
(``ANALYZERS_EXTRA``), probe files named inside ``ANALYZER_PROBE_DIR``, and where analyses
run — off the event loop and off the engine's decode loop, after the generation has
finished and the engine has moved on:

- **embedded** (``MILLM_TASKS_IN_PROCESS``): on a small thread pool of the process
  (``ANALYSIS_WORKERS``);
- **distributed**: as a Celery task on the ``analysis`` queue (``monitoring.tasks``),
  consumed by workers started for it (deploy/). The web process ships the analyzers' names
  and params and the capture — its bytes when inline, its id when stored (the worker reads
  the file under ``CAPTURE_DIR``, which it must see) — and waits for the entries in the
  result backend (Redis) at most ``ANALYSIS_TIMEOUT_S``. With no worker on the queue in
  time the analysis does not run anywhere: a /v1 entry is the error
  ``analysis_unavailable``, ``/api/captures/{id}/analyze`` a 503 ``ANALYSIS_UNAVAILABLE``
  (the task expires unread).

Either way a request's analyzer params are checked in the web process before generation
(``prepare``: names, params, probe files), and checked again where they run.

The math lives in ``gpu_engine.analysis`` (no Django, no torch); this module only names,
prepares, arms and runs it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import close_old_connections, connections

from core.errors import MillmError, from_engine_error
from core.jobs import resolve_task
from gpu_engine.api.analysis import (
    AnalysisContext,
    AnalyzerRegistry,
    CaptureNeed,
    check_capture,
    default_registry,
    load_extra,
)
from gpu_engine.api.capabilities import Capabilities
from gpu_engine.api.errors import AnalyzerCaptureMissing, EngineError, error_from_dict
from monitoring.errors import AnalysisUnavailable
from monitoring.ownership import EVERYONE, Scope

log = structlog.get_logger(__name__)

# analyses running at once in one web process; more wait in the pool's queue (each is
# bounded by its capture, itself bounded by CAPTURE_MAX_BYTES)
ANALYSIS_WORKERS = 2


@dataclass(frozen=True)
class PreparedAnalysis:
    """One ``analyze`` entry whose params the analyzer accepted (probe files loaded)."""

    name: str
    analyzer: Any
    prepared: Any
    need: CaptureNeed
    params: dict[str, Any]  # as asked: what the analysis queue's worker prepares again
    # whose stored captures an analyzer may read (CoRe's N/A run): the caller's
    scope: Scope = EVERYONE


def _stored_loader(scope: Scope) -> Callable[[str], Any]:
    """A stored capture by id (CoRe's N/A run): only ever a file of a ``Capture`` row the
    caller may see (another key's capture is not found, as on /api/captures)."""

    def load(capture_id: str) -> Any:
        from gpu_engine.api.artifacts import load_capture
        from monitoring.selectors import capture_file

        return load_capture(capture_file(capture_id=capture_id, scope=scope))

    return load


def _error_entry(name: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, EngineError):
        return {"name": name, "error": {"code": exc.code, "message": exc.message}}
    if isinstance(exc, MillmError):
        return {"name": name, "error": {"code": exc.code.lower(), "message": exc.message}}
    log.error(
        "analysis_failed", analyzer=name, error_type=type(exc).__name__, exc_info=(type(exc), exc, exc.__traceback__)
    )
    return {"name": name, "error": {"code": "analysis_failed", "message": f"analyzer {name!r} failed on this capture"}}


class Analyzers:
    """The process's analyzer registry and pool (a runtime part: ``runtime().analyzers``)."""

    def __init__(
        self,
        registry: AnalyzerRegistry,
        probe_dir: str | Path,
        workers: int = ANALYSIS_WORKERS,
        *,
        remote: bool = False,
        timeout_s: float = 120.0,
    ) -> None:
        self.registry = registry
        self.probe_dir = Path(probe_dir)
        # distributed: analyses run on the Celery analysis queue, not on this pool
        self.remote = remote
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="millm-analysis")

    @classmethod
    def from_settings(cls) -> Analyzers:
        """The built-in analyzers plus ``ANALYZERS_EXTRA``'s (``ValueError`` naming a bad
        entry: the site stops start-up on it); remote in distributed mode."""
        registry = default_registry()
        load_extra(registry, settings.ANALYZERS_EXTRA)
        return cls(
            registry,
            settings.ANALYZER_PROBE_DIR,
            remote=not settings.MILLM_TASKS_IN_PROCESS,
            timeout_s=float(settings.ANALYSIS_TIMEOUT_S),
        )

    def context(self, scope: Scope = EVERYONE) -> AnalysisContext:
        return AnalysisContext(probe_dir=self.probe_dir, load_capture=_stored_loader(scope))

    # ------------------------------------------------------------------ preparing

    def prepare(self, asked: Iterable[tuple[str, dict[str, Any]]], scope: Scope = EVERYONE) -> list[PreparedAnalysis]:
        """Each analyzer by name with its params validated (probe files read): raises
        ``UnknownAnalyzer`` (listing the known names), ``InvalidParameter`` or
        ``InvalidProbeFile`` before anything runs."""
        ctx = self.context(scope)
        out = []
        for name, params in asked:
            analyzer = self.registry.get(name)
            prepared = analyzer.prepare(dict(params), ctx)
            out.append(PreparedAnalysis(name, analyzer, prepared, analyzer.needs(prepared), dict(params), scope))
        return out

    async def aprepare(
        self, asked: Iterable[tuple[str, dict[str, Any]]], scope: Scope = EVERYONE
    ) -> list[PreparedAnalysis]:
        return await self._submit(self.prepare, list(asked), scope)

    @staticmethod
    def need(analyses: list[PreparedAnalysis]) -> CaptureNeed:
        need = CaptureNeed()
        for a in analyses:
            need = need.merged(a.need)
        return need

    # ------------------------------------------------------------------ running

    def run(
        self, analyses: list[PreparedAnalysis], source: bytes | Path | None, *, strict: bool = False
    ) -> list[dict[str, Any]]:
        """Every analysis on one capture (its bytes or its file): ``[{name, result}]``.
        A failure on this capture (a span past the prompt, a probe of another width) is
        that entry's ``error`` — the generation has been answered already — unless
        ``strict``, where it raises (``/api/captures/{id}/analyze``)."""
        from gpu_engine.api.artifacts import load_capture

        ctx = self.context(analyses[0].scope if analyses else EVERYONE)
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
                    raise AnalyzerCaptureMissing(f"analyzer {a.name!r} got no capture", details={"param": "analyze"})
                check_capture(capture.meta, a.need, a.name)
                out.append({"name": a.name, "result": a.analyzer.run(capture, a.prepared, ctx)})
            except Exception as exc:  # noqa: BLE001 - one analyzer's failure is its entry
                if strict:
                    raise
                out.append(_error_entry(a.name, exc))
        return out

    async def arun(
        self, analyses: list[PreparedAnalysis], source: bytes | Path | None, *, capture_id: str | None = None
    ) -> list[dict[str, Any]]:
        """``run`` (not strict) where analyses run: this pool, or the analysis queue
        (``capture_id`` names a stored ``source`` there)."""
        if self.remote:
            try:
                return await asyncio.to_thread(self.run_remote, analyses, source, capture_id=capture_id)
            except AnalysisUnavailable as exc:
                return [_error_entry(a.name, exc) for a in analyses]
        return await self._submit(self.run, analyses, source)

    def run_stored(self, analyses: list[PreparedAnalysis], path: Path, capture_id: str) -> list[dict[str, Any]]:
        """``run`` strictly on a stored capture, waited for (synchronous callers): on the
        analysis queue in distributed mode, else on this pool."""
        if self.remote:
            return self.run_remote(analyses, path, capture_id=capture_id, strict=True)
        return self.run_wait(lambda: self.run(analyses, path, strict=True))

    def run_remote(
        self,
        analyses: list[PreparedAnalysis],
        source: bytes | Path | None,
        *,
        capture_id: str | None = None,
        strict: bool = False,
    ) -> list[dict[str, Any]]:
        """The analyses as one ``analysis`` queue task, its entries waited for at most
        ``timeout_s`` (``AnalysisUnavailable`` past it: nothing ran here). With ``strict``
        the worker's refusal is raised here as the error it was."""
        from celery.exceptions import TimeoutError as ResultTimeout

        if source is None:
            shipped = None
        elif isinstance(source, (bytes, bytearray)):
            shipped = {"data": base64.b64encode(bytes(source)).decode("ascii")}
        elif capture_id is not None:
            shipped = {"capture_id": capture_id}
        else:
            raise ValueError("a stored capture goes to the analysis queue by its id")
        asked = [[a.name, a.params] for a in analyses]
        scope = analyses[0].scope if analyses else EVERYONE
        # by name: monitoring.tasks imports this module (core.jobs.resolve_task)
        task = resolve_task("monitoring.tasks.analysis_run_task")
        result = task.apply_async(
            args=(asked, shipped, strict, [scope.owner, scope.all]), queue="analysis", expires=self.timeout_s
        )
        try:
            out = result.get(timeout=self.timeout_s, propagate=True)
        except ResultTimeout:
            result.revoke()  # and it expires unread: a late worker does not run it
            raise AnalysisUnavailable(
                f"no analysis worker answered within {self.timeout_s:g} s: in distributed "
                "mode analyses run on the Celery 'analysis' queue (start a worker with "
                "-Q analysis)",
                details={"queue": "analysis", "timeout_s": self.timeout_s},
                retry_after=int(self.timeout_s),
            ) from None
        finally:
            result.forget()
        if "error" in out:
            raise _shipped_error(out["error"])
        return out["entries"]

    async def acall(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool, awaited (hidden-state probes on a capture)."""
        return await self._submit(fn, *args)

    def run_wait(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool, waited for (synchronous callers)."""
        return self._pool.submit(self._in_pool, fn, *args).result(timeout=self.timeout_s)

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


def analysis_check_backend(
    *, need: CaptureNeed, capabilities: Capabilities | None, backend: str, analyzers: list[str]
) -> None:
    """Refuse, before generation, analyzers whose capture the loaded backend cannot take
    (vLLM reports neither capture capability today; llama.cpp no Q/K on a model without
    rotary embedding)."""
    if capabilities is None:
        return  # nothing reported: the engine refuses the capture itself
    wants = []
    if need.layers:
        wants.append(("hidden_state_capture", capabilities.hidden_state_capture, "hidden states"))
    if need.qk_layers:
        wants.append(("attention_capture", capabilities.attention_capture, "attention Q/K"))
    for capability, has, what in wants:
        if not has:
            names = ", ".join(repr(n) for n in analyzers)
            raise AnalyzerCaptureMissing(
                f"analyzer {names} reads {what}, which the {backend} backend cannot capture ({capability} is off)",
                details={"param": "analyze", "backend": backend, "capability": capability, "analyzers": analyzers},
            )


def capture_analyze(
    *, capture_id: str, name: str, params: dict[str, Any], analyzers: Analyzers, scope: Scope = EVERYONE
) -> dict[str, Any]:
    """Run analyzer ``name`` on a stored capture: ``CAPTURE_NOT_FOUND`` for an id that is
    not a stored capture, ``ANALYZER_CAPTURE_MISSING`` when the capture lacks what the
    analyzer reads, the analyzer's own refusals otherwise."""
    from monitoring.selectors import capture_file

    # CaptureNotFound (also another owner's); never outside CAPTURE_DIR
    path = capture_file(capture_id=capture_id, scope=scope)
    try:
        prepared = analyzers.run_wait(analyzers.prepare, [(name, params)], scope)
        (entry,) = analyzers.run_stored(prepared, path, capture_id)
    except EngineError as exc:  # one engine table for every surface
        raise from_engine_error(exc) from None
    return {"capture_id": capture_id, "name": name, "result": entry["result"]}


# ---------------------------------------------------------------------- the analysis queue


def _shipped_error(error: dict[str, Any]) -> Exception:
    """The refusal a worker sent back (``run_shipped``), as the error it was."""
    if error.get("kind") == "engine":
        return error_from_dict(error)
    out = MillmError(str(error.get("message", "")), details=error.get("details") or {})
    out.code = str(error.get("code") or MillmError.code)  # type: ignore[misc]
    out.status = int(error.get("status") or MillmError.status)  # type: ignore[misc]
    return out


def run_shipped(
    asked: list[list[Any]], source: dict[str, str] | None, *, strict: bool, scope: Scope = EVERYONE
) -> dict[str, Any]:
    """The analysis queue's task body (``monitoring.tasks``), in the worker: the analyzers
    prepared from their names and params, run on the capture shipped (its bytes, or a
    stored capture's id, read under this worker's ``CAPTURE_DIR``). ``{"entries": [...]}``,
    or with ``strict`` ``{"error": ...}`` for a refusal (``/api/captures/{id}/analyze``);
    without it a refusal is each entry's error, as on the pool."""
    from core.runtime import runtime
    from monitoring.selectors import capture_file

    analyzers: Analyzers = runtime().analyzers
    close_old_connections()
    try:
        path: bytes | Path | None = None
        if source is not None:
            path = (
                base64.b64decode(source["data"]) if "data" in source else capture_file(capture_id=source["capture_id"])
            )
        prepared = analyzers.prepare([(str(name), dict(params)) for name, params in asked], scope)
        return {"entries": analyzers.run(prepared, path, strict=strict)}
    except (EngineError, MillmError) as exc:
        if not strict:
            return {"entries": [_error_entry(str(name), exc) for name, _ in asked]}
        if isinstance(exc, EngineError):
            return {"error": {"kind": "engine", **exc.to_dict()}}
        return {
            "error": {
                "kind": "millm",
                "code": exc.code,
                "status": exc.status,
                "message": exc.message,
                "details": exc.details,
            }
        }
    finally:
        connections.close_all()


__all__ = [
    "ANALYSIS_WORKERS",
    "Analyzers",
    "PreparedAnalysis",
    "analysis_check_backend",
    "capture_analyze",
    "run_shipped",
]
