"""Process metrics (prometheus-client): requests by route and code, queue depth, tokens
generated, steering applications, refusals by reason, downloads and loads.

Counters that other parts of the server advance go through the ``record_*`` functions
here, so every name is declared once. Figures that already live elsewhere (the admission
queue, the engine's per-attachment ``steering_apply_count``, the hub breaker) are read at
scrape time by a collector instead of being copied into gauges.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from prometheus_client import REGISTRY, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from millm_site.middleware import LoopMiddleware

log = structlog.get_logger(__name__)

REQUESTS = Counter("millm_http_requests", "HTTP requests answered, by surface, route "
                   "pattern, method and status code",
                   ["surface", "route", "method", "code"])
REQUEST_SECONDS = Histogram("millm_http_request_duration_seconds",
                            "Time to the response headers, by surface", ["surface"],
                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                     30, 60))
TOKENS = Counter("millm_tokens_generated", "Completion tokens generated", ["model"])
PROMPT_TOKENS = Counter("millm_prompt_tokens", "Prompt tokens processed", ["model"])
REFUSALS = Counter("millm_refusals", "Requests refused before generation, by reason "
                   "(queue_full, model_busy, model_not_loaded, unauthorized, …)", ["reason"])
DOWNLOADS = Counter("millm_downloads", "Finished downloads by kind and outcome",
                    ["kind", "outcome"])
LOADS = Counter("millm_model_loads", "Finished model loads and unloads by outcome",
                ["operation", "outcome"])

STARTED_AT = time.time()


def record_tokens(*, model: str, completion_tokens: int, prompt_tokens: int = 0) -> None:
    if completion_tokens:
        TOKENS.labels(model=model).inc(completion_tokens)
    if prompt_tokens:
        PROMPT_TOKENS.labels(model=model).inc(prompt_tokens)


def record_refusal(reason: str) -> None:
    REFUSALS.labels(reason=reason).inc()


def record_download(*, kind: str, outcome: str) -> None:
    DOWNLOADS.labels(kind=kind, outcome=outcome).inc()


def record_load(*, operation: str, outcome: str) -> None:
    LOADS.labels(operation=operation, outcome=outcome).inc()


def _sum(counter: Counter, **match: str) -> float:
    total = 0.0
    for metric in counter.collect():
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            if all(sample.labels.get(k) == v for k, v in match.items()):
                total += sample.value
    return total


def _by_label(counter: Counter, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


class _LiveCollector:
    """Figures read when scraped: queue, engine attachments, model, hub breakers."""

    def describe(self):
        # Registration would otherwise call collect() at import time, before Django and
        # the engine are ready; these names are declared nowhere else.
        return []

    def collect(self):
        from millm_site import health

        figures = health.inference_figures()
        depth = GaugeMetricFamily("millm_queue_depth", "Requests waiting for a slot")
        depth.add_metric([], figures.get("waiting") or 0)
        yield depth
        in_flight = GaugeMetricFamily("millm_requests_in_flight", "Requests holding a slot")
        in_flight.add_metric([], figures.get("in_flight") or 0)
        yield in_flight
        # the admission controller's own totals (queue_full refusals included)
        for key, help_text in (("admitted_total", "Generation requests given a slot"),
                               ("refused_total", "Generation requests refused: queue full")):
            if figures.get(key) is not None:
                family = CounterMetricFamily(f"millm_admission_{key.removesuffix('_total')}",
                                             help_text)
                family.add_metric([], figures[key])
                yield family

        engine = health.engine_snapshot()
        loaded = GaugeMetricFamily("millm_model_loaded", "1 while a model is resident")
        loaded.add_metric([], 1 if engine.get("state") == "ready" else 0)
        yield loaded
        steering = GaugeMetricFamily(
            "millm_steering_apply_count",
            "Forward passes in which an attachment's steering delta was really added "
            "(cumulative per attachment; restarts at attach)", labels=["sae_id", "layer"])
        for attachment in engine.get("attachments", []):
            steering.add_metric([attachment["sae_id"], str(attachment["layer"])],
                                attachment.get("steering_apply_count", 0))
        yield steering

        from registry import hub

        circuit = GaugeMetricFamily("millm_circuit_open", "1 while a circuit breaker is open",
                                    labels=["name"])
        for state in hub.circuit_states():
            circuit.add_metric([state["name"]], 1 if state["state"] == "open" else 0)
        yield circuit


REGISTRY.register(_LiveCollector())


def prometheus_text() -> bytes:
    return generate_latest(REGISTRY)


def snapshot() -> dict[str, Any]:
    """The JSON form of /api/health/metrics."""
    from millm_site import health

    requests_by_code = _by_label(REQUESTS, "code")
    errors = sum(v for code, v in requests_by_code.items() if code[:1] in ("4", "5"))
    engine = health.engine_snapshot()
    return {
        "uptime_seconds": round(time.time() - STARTED_AT, 3),
        "requests": {
            "total": int(sum(requests_by_code.values())),
            "errors": int(errors),
            "by_code": {k: int(v) for k, v in sorted(requests_by_code.items())},
            "by_surface": {k: int(v) for k, v in sorted(_by_label(REQUESTS, "surface").items())},
        },
        "queue": health.inference_figures(),
        "tokens_generated": int(_sum(TOKENS)),
        "prompt_tokens": int(_sum(PROMPT_TOKENS)),
        "refusals": {k: int(v) for k, v in sorted(_by_label(REFUSALS, "reason").items())},
        "steering_apply_count": [
            {"sae_id": a["sae_id"], "layer": a["layer"],
             "steering_apply_count": a.get("steering_apply_count", 0)}
            for a in engine.get("attachments", [])],
        "downloads": {f"{k}": int(v) for k, v in sorted(_by_label(DOWNLOADS, "outcome").items())},
        "model_loads": {k: int(v) for k, v in sorted(_by_label(LOADS, "outcome").items())},
        "model_loaded": engine.get("state") == "ready",
        "model_name": engine.get("model_id"),
    }


def _surface(path: str) -> str:
    if path.startswith("/api/") or path == "/api":
        return "api"
    if path.startswith("/v1/") or path == "/v1":
        return "v1"
    if path.startswith("/admin/"):
        return "admin"
    return "other"


class MetricsMiddleware(LoopMiddleware):
    """Counts every answer by route pattern (bounded label values) and status, and makes
    sure no 503 leaves without Retry-After (RETRY_AFTER_FALLBACK_S, logged).

    A LoopMiddleware: its hooks run on the event loop, so a /v1 stream pays no thread hop
    for them."""

    def process_request(self, request):
        request._millm_started = time.perf_counter()

    def process_response(self, request, response):
        surface = _surface(request.path)
        if response.status_code == 503 and not response.has_header("Retry-After"):
            from millm_site.api import retry_after_value

            response["Retry-After"] = str(retry_after_value(503, None, f"{surface}:503"))
        match = getattr(request, "resolver_match", None)
        route = match.route if match is not None and match.route else "unmatched"
        try:
            REQUESTS.labels(surface=surface, route=route, method=request.method,
                            code=str(response.status_code)).inc()
            started = getattr(request, "_millm_started", None)
            if started is not None:
                REQUEST_SECONDS.labels(surface=surface).observe(time.perf_counter() - started)
            if response.status_code == 401 and surface in ("api", "v1"):
                record_refusal("unauthorized")
        except Exception:
            log.warning("metrics_record_failed", exc_info=True)
        return response
