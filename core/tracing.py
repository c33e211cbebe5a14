"""OTEL_ENABLED: the process's tracer provider (service name, OTLP over HTTP), built once
at start by the site (``millm_site.apps``) for web, Celery and engine processes alike;
the spans themselves are ``gpu_engine.api.tracing``'s."""

from __future__ import annotations

from typing import Any

from gpu_engine.api import tracing


def configure(*, exporter: Any = None) -> Any:
    """Trace with a provider sending to OTEL_EXPORTER_OTLP_ENDPOINT (or to ``exporter``,
    span by span: tests pass the SDK's in-memory exporter); returns the provider."""
    from django.conf import settings
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": settings.OTEL_SERVICE_NAME}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.OTEL_EXPORTER_OTLP_ENDPOINT
        target = f"{endpoint.rstrip('/')}/v1/traces" if endpoint else None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=target)))
    tracing.enable(provider)
    return provider
