"""What /api/health/metrics and the Prometheus scrape show: the counters of
``core.metrics`` plus figures read at scrape time from where they live (the admission
queue, the engine's per-attachment ``steering_apply_count``, the hub breakers)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from core.metrics import (
    DOWNLOADS,
    LOADS,
    PROMPT_TOKENS,
    REFUSALS,
    REQUESTS,
    STARTED_AT,
    TOKENS,
    _by_label,
    _sum,
)


class _LiveCollector:
    """Figures read when scraped: queue, engine attachments, model, hub breakers."""

    def describe(self):
        # Registration would otherwise call collect() at import time, before Django and
        # the engine are ready; these names are declared nowhere else.
        return []

    def collect(self):
        from system import health

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
    from system import health

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


