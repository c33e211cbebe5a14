"""The engine's own figures in the metrics (docs/operators.md, "Metrics"): batch
occupancy, queue depth, KV bytes, step time and tokens per second, as each engine
publishes them in its status (its heartbeat in distributed mode), labelled by engine.

Every engine of ENGINE_MODELS gets its entry (``default`` alone when it is unset), each
read from that engine's own status.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (key in the figures, metric name, help, kind): gauges are read now, counters since the
# model loaded (the scheduler restarts with each load)
_FAMILIES = (
    ("occupancy", "millm_engine_batch_occupancy", "Rows the batch runs ÷ the rows it may run", "gauge"),
    ("running", "millm_engine_running_rows", "Requests running in the batch", "gauge"),
    ("max_rows", "millm_engine_max_rows", "Rows the batch may run (interactive + batch rows)", "gauge"),
    ("queue_depth", "millm_engine_queue_depth", "Requests the engine holds waiting for a row", "gauge"),
    ("kv_bytes_in_use", "millm_engine_kv_bytes_in_use", "Bytes of KV cache the running requests hold", "gauge"),
    ("kv_capacity_bytes", "millm_engine_kv_capacity_bytes", "Bytes of KV cache reserved", "gauge"),
    ("step_seconds_last", "millm_engine_step_seconds", "The last decode step's time", "gauge"),
    ("tokens_per_second", "millm_engine_tokens_per_second", "Tokens generated per second, last 10 s", "gauge"),
    ("decode_steps", "millm_engine_decode_steps", "Decode steps since the model loaded", "counter"),
    ("decode_seconds_total", "millm_engine_decode_seconds", "Seconds in decode steps since the load", "counter"),
    ("generated_tokens_total", "millm_engine_generated_tokens", "Tokens the batch generated since the load", "counter"),
)


def _statuses(default: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, status) of every engine; ``default``: the default engine's, read already."""
    from core.engines import DEFAULT_ENGINE, engine_names
    from system.figures import engine_snapshot

    return [(name, default if name == DEFAULT_ENGINE else engine_snapshot(name)) for name in engine_names()]


def engine_figures(engine: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per engine (``engine``: the default engine's status, read already): its
    name, state, model and the batch's figures (None where the engine runs no batch:
    serial mode, nothing loaded, unreachable)."""
    return [_figures(name, status) for name, status in _statuses(engine)]


def _figures(name: str, engine: dict[str, Any]) -> dict[str, Any]:
    batching = engine.get("batching") or {}
    # the figures of a loaded engine, batched or serial (nothing loaded: none)
    batched = "occupancy" in batching
    kv = batching.get("kv") or {}

    def pick(key: str) -> Any:
        return batching.get(key) if batched else None

    return {
        "engine": name,
        "state": engine.get("state"),
        "model_name": engine.get("model_id"),
        "backend": engine.get("backend"),
        "occupancy": pick("occupancy"),
        "running": pick("running"),
        "max_rows": pick("max_rows"),
        "queue_depth": pick("queue_depth"),
        "kv_bytes_in_use": kv.get("bytes_in_use") if batched else None,
        "kv_capacity_bytes": kv.get("capacity_bytes") if batched else None,
        "kv_source": kv.get("source") if batched else None,
        "step_seconds_last": pick("step_seconds_last"),
        "step_seconds_mean": pick("step_seconds_mean"),
        "tokens_per_second": pick("tokens_per_second"),
        "decode_steps": pick("decode_steps"),
        "decode_seconds_total": pick("decode_seconds_total"),
        "generated_tokens_total": pick("generated_tokens_total"),
    }


def engine_families(engine: dict[str, Any]):
    rows = engine_figures(engine)
    for key, name, help_text, kind in _FAMILIES:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(name, help_text, labels=["engine"])
        for row in rows:
            if row.get(key) is not None:
                family.add_metric([row["engine"]], row[key])
        yield family
