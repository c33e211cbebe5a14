"""What /api/health/metrics and the Prometheus scrape show: the counters of
``core.metrics`` plus figures read at scrape time from where they live (the admission
queue, the engine's per-attachment ``steering_apply_count``, the hub breakers) — and the
``system:metrics`` event that brings the main figures to /ws/events clients."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from django.conf import settings
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from core.events import send_to
from core.metrics import ADMISSIONS, DOWNLOADS, LOADS, PROMPT_TOKENS, REFUSALS, REQUESTS, SHARED, TOKENS, store
from core.metrics_store import by_label, families, total
from gpu_engine.api.capabilities import capabilities_of
from system.engine_metrics import engine_families, engine_figures
from system.figures import engine_snapshot, inference_figures

log = structlog.get_logger(__name__)

EVENT = "system:metrics"
# the figures a dashboard shows; the rest of /api/health/metrics stays a request away
PUSHED_KEYS = (
    "uptime_seconds",
    "requests",
    "queue",
    "tokens_generated",
    "prompt_tokens",
    "refusals",
    "model_loaded",
    "model_name",
    "engines",
)


class _LiveCollector:
    """Figures read when scraped: queue, engine attachments, model, hub breakers."""

    def describe(self):
        # Registration would otherwise call collect() at import time, before Django and
        # the engine are ready; these names are declared nowhere else.
        return []

    def collect(self):
        figures = _stack_queue(store().samples()) if store().shared else inference_figures()
        depth = GaugeMetricFamily("millm_queue_depth", "Requests waiting for a slot")
        depth.add_metric([], figures.get("waiting") or 0)
        yield depth
        in_flight = GaugeMetricFamily("millm_requests_in_flight", "Requests holding a slot")
        in_flight.add_metric([], figures.get("in_flight") or 0)
        yield in_flight
        # the admission controller's own totals (queue_full refusals included)
        for key, help_text in (
            ("admitted_total", "Generation requests given a slot"),
            ("refused_total", "Generation requests refused: queue full"),
        ):
            if figures.get(key) is not None:
                family = CounterMetricFamily(f"millm_admission_{key.removesuffix('_total')}", help_text)
                family.add_metric([], figures[key])
                yield family

        engine = engine_snapshot()
        loaded = GaugeMetricFamily("millm_model_loaded", "1 while a model is resident")
        loaded.add_metric([], 1 if engine.get("state") == "ready" else 0)
        yield loaded
        steering = GaugeMetricFamily(
            "millm_steering_apply_count",
            "Forward passes in which an attachment's steering delta was really added "
            "(cumulative per attachment; restarts at attach)",
            labels=["sae_id", "layer"],
        )
        for attachment in engine.get("attachments", []):
            steering.add_metric(
                [attachment["sae_id"], str(attachment["layer"])], attachment.get("steering_apply_count", 0)
            )
        yield steering
        # TORCH_COMPILE: graphs compiled since the model loaded, recompiles included
        caps = capabilities_of((engine.get("batching") or {}).get("capabilities"))
        compiled = caps.torch_compile_status if caps is not None else None
        if compiled:
            graphs = CounterMetricFamily(
                "millm_torch_compile_graphs",
                "Graphs torch.compile built for the loaded model's decode step, recompiles included (restarts at load)",
            )
            graphs.add_metric([], compiled["compiles"])
            yield graphs

        yield from _prefix_cache_families(engine)
        yield from engine_families(engine)

        from registry import hub

        circuit = GaugeMetricFamily("millm_circuit_open", "1 while a circuit breaker is open", labels=["name"])
        for state in hub.circuit_states():
            circuit.add_metric([state["name"]], 1 if state["state"] == "open" else 0)
        yield circuit


def prefix_cache_figures(engine: dict[str, Any]) -> dict[str, Any] | None:
    """The loaded backend's prefix cache (PREFIX_CACHE_MAX_MB; docs/engine.md, "Prefix
    cache"): budget, bytes, entries, and per class (unsteered, prompt_steered,
    decode_only) lookups, hits, tokens reused, bypasses and the hit rate; None where the
    backend keeps none (vLLM has its own, no model loaded)."""
    return (engine.get("memory") or {}).get("prefix_cache")


def _prefix_cache_families(engine: dict[str, Any]):
    cache = prefix_cache_figures(engine)
    if not cache:
        return
    for key, help_text in (
        ("bytes", "Bytes of KV the prefix cache holds"),
        ("budget_bytes", "The prefix cache's budget (PREFIX_CACHE_MAX_MB)"),
        ("entries", "Sequences the prefix cache holds"),
    ):
        gauge = GaugeMetricFamily(f"millm_prefix_cache_{key}", help_text)
        gauge.add_metric([], cache.get(key) or 0)
        yield gauge
    classes = cache.get("classes") or {}
    for key, help_text in (
        ("lookups", "Prefix cache lookups by request class (restarts at load)"),
        ("hits", "Prefix cache lookups that reused stored KV, by request class (restarts at load)"),
        ("tokens_reused", "Prompt tokens not prefilled thanks to the prefix cache, by request class"),
        ("bypassed", "Requests that recomputed their whole prompt because they read prompt rows, by class"),
    ):
        family = CounterMetricFamily(f"millm_prefix_cache_{key}", help_text, labels=["class"])
        for name, figures in sorted(classes.items()):
            family.add_metric([name], figures.get(key) or 0)
        yield family
    rate = GaugeMetricFamily(
        "millm_prefix_cache_hit_rate", "Prefix cache hits ÷ lookups by request class (0 before any)", labels=["class"]
    )
    for name, figures in sorted(classes.items()):
        rate.add_metric([name], figures.get("hit_rate") or 0.0)
    yield rate


_LIVE = _LiveCollector()
REGISTRY.register(_LIVE)


class _StackCollector:
    """Distributed mode: the stack's sums of ``core.metrics``' counters and histograms
    (core.metrics_store), in place of this process's own."""

    def describe(self):
        return []

    def collect(self):
        yield from families(SHARED, store().samples())


# the scrape of a distributed stack: the sums and the figures read where they live; the
# process_* and python_* collectors are left out, since each worker's would differ
_STACK_REGISTRY = CollectorRegistry(auto_describe=False)
_STACK_REGISTRY.register(_StackCollector())
_STACK_REGISTRY.register(_LIVE)


def prometheus_text() -> bytes:
    return generate_latest(_STACK_REGISTRY if store().shared else REGISTRY)


def _stack_queue(samples: dict) -> dict[str, Any]:
    """The queue's figures; in distributed mode its admitted and refused totals are every
    web process's (each process's controller counts only its own)."""
    figures = inference_figures()
    if store().shared:
        decisions = by_label(samples, ADMISSIONS._name, "outcome")
        figures["admitted_total"] = int(decisions.get("admitted", 0))
        figures["refused_total"] = int(decisions.get("refused", 0))
    return figures


def snapshot() -> dict[str, Any]:
    """The JSON form of /api/health/metrics: the stack's sums (distributed mode) or this
    process's counters (embedded mode), and the engine's and the queue's figures now."""
    figures = store()
    samples = figures.samples()
    requests_by_code = by_label(samples, REQUESTS._name, "code")
    errors = sum(v for code, v in requests_by_code.items() if code[:1] in ("4", "5"))
    engine = engine_snapshot()
    return {
        "uptime_seconds": round(time.time() - figures.started_at, 3),
        "requests": {
            "total": int(sum(requests_by_code.values())),
            "errors": int(errors),
            "by_code": {k: int(v) for k, v in sorted(requests_by_code.items())},
            "by_surface": {k: int(v) for k, v in sorted(by_label(samples, REQUESTS._name, "surface").items())},
        },
        "queue": _stack_queue(samples),
        "tokens_generated": int(total(samples, TOKENS._name)),
        "prompt_tokens": int(total(samples, PROMPT_TOKENS._name)),
        "refusals": {k: int(v) for k, v in sorted(by_label(samples, REFUSALS._name, "reason").items())},
        "steering_apply_count": [
            {"sae_id": a["sae_id"], "layer": a["layer"], "steering_apply_count": a.get("steering_apply_count", 0)}
            for a in engine.get("attachments", [])
        ],
        "downloads": {f"{k}": int(v) for k, v in sorted(by_label(samples, DOWNLOADS._name, "outcome").items())},
        "model_loads": {k: int(v) for k, v in sorted(by_label(samples, LOADS._name, "outcome").items())},
        "model_loaded": engine.get("state") == "ready",
        "model_name": engine.get("model_id"),
        "prefix_cache": prefix_cache_figures(engine),
        "engines": engine_figures(engine),
    }


def pushed_snapshot() -> dict[str, Any]:
    """The data of a ``system:metrics`` event: the main figures of ``snapshot()``, with
    the same keys and values (counters, no request content)."""
    full = snapshot()
    return {key: full[key] for key in PUSHED_KEYS}


class MetricsPush:
    """Sends ``system:metrics`` to this process's /ws/events clients every
    METRICS_PUSH_INTERVAL_S seconds while at least one is connected: one task per process,
    on the loop that serves the sockets, started by the first client's connect and ended
    when the last one leaves. A client that joins gets the figures at once.

    The figures go to this process's own consumers, not to the event group: each web
    process sends the same stack-wide sums (distributed mode: core.metrics_store), and a
    group send would repeat them on every socket once per process. The consumers call ``join``/``leave``
    on their loop, so no lock is needed."""

    def __init__(self) -> None:
        self._channels: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    @staticmethod
    def interval() -> float:
        return float(settings.METRICS_PUSH_INTERVAL_S)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def join(self, channel_name: str) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._task.get_loop() is not loop:
            # a server on another loop (tests run several): its clients went with it
            self._stop()
            self._channels.clear()
        self._channels.add(channel_name)
        if self.interval() <= 0:
            return
        if not self.running:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="metrics-push")
        assert self._wake is not None
        self._wake.set()

    def leave(self, channel_name: str) -> None:
        self._channels.discard(channel_name)
        if not self._channels:
            self._stop()

    def _stop(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        loop = task.get_loop()
        try:
            if loop.is_closed():
                return
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop closed meanwhile
            pass

    close = _stop  # Runtime.shutdown

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while self._channels:
            interval = self.interval()
            if interval <= 0:
                break
            wake.clear()
            try:
                # the engine's status may be a Redis round trip (distributed mode)
                data = await asyncio.to_thread(pushed_snapshot)
            except Exception:
                log.warning("metrics_push_failed", exc_info=True)
            else:
                await send_to(list(self._channels), EVENT, data)
            try:
                await asyncio.wait_for(wake.wait(), interval)
            except TimeoutError:
                pass
