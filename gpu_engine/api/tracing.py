"""OpenTelemetry traces of generations (OTEL_ENABLED; off by default): the web tier's
span for a /v1 request and the engine's span for each of its jobs, one trace, both
carrying the request id and the steering hash. The job carries its parent span as a W3C
``traceparent`` (``GenerationJob.traceparent``), so the trace crosses the Redis streams
to ``run_engine`` as it crosses the call in an embedded process.

Off (nothing ``enable``d), every function here returns at once and nothing imports
opentelemetry: the packages are needed only where it is on (start-up checks that).
Framework-free, torch-free: the web tier and the engine both import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_tracer: Any = None


def enable(provider: Any = None) -> None:
    """Trace from now on, with ``provider`` (an SDK ``TracerProvider``) or the global one."""
    global _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer("millm", tracer_provider=provider)


def disable() -> None:
    global _tracer
    _tracer = None


def enabled() -> bool:
    return _tracer is not None


@contextmanager
def request_span(name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    """A span around the caller's block (None when tracing is off); the jobs submitted in
    it name it as their parent (``traceparent``)."""
    tracer = _tracer
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(name, attributes=_clean(attributes)) as span:
        yield span


def traceparent() -> str | None:
    """The current span as a W3C ``traceparent`` header value (None when off or none)."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def start_job_span(name: str, parent: str | None, attributes: dict[str, Any]) -> Any:
    """The engine's span of one job, a child of the ``traceparent`` it carries (a root
    span when it carries none); None when off. The caller ends it."""
    tracer = _tracer
    if tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
    return tracer.start_span(name, context=context, attributes=_clean(attributes))


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
