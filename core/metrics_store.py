"""Where the counters of ``core.metrics`` are read from: this process (embedded mode) or
the sum over every process of the stack, kept in Redis (distributed mode).

Each process still counts in its own prometheus-client counters (an increment is a
local add: nothing on the request's path waits for Redis). A flusher thread sends what
each sample grew since its last flush to one Redis hash with ``HINCRBYFLOAT``, every
METRICS_FLUSH_INTERVAL_S and when the process exits; a process reading the figures
flushes its own first. Only growth is ever sent, so the sums never go down: not when a
worker restarts (its counters start again at 0, its earlier growth is already in Redis),
not when a reader asks another worker. Histograms are their bucket, sum and count
samples, each such a counter.

prometheus-client's multiprocess mode sums processes through files in one directory:
web replicas on other hosts or containers (docs/deploy.md: "any number of replicas")
share no directory, and they all share Redis, which distributed mode requires anyway.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import structlog
from prometheus_client.metrics import MetricWrapperBase

from core.errors import EngineUnavailable

log = structlog.get_logger(__name__)

# a sample: (sample name, sorted label pairs)
SampleKey = tuple[str, tuple[tuple[str, str], ...]]
Sample = tuple[str, dict[str, str], float]

# the sample suffixes that only grow (a counter's _total; a histogram's parts)
_GROWING = ("_total", "_bucket", "_sum", "_count")


def local_samples(metrics: Iterable[MetricWrapperBase]) -> dict[SampleKey, float]:
    out: dict[SampleKey, float] = {}
    for metric in metrics:
        for family in metric.collect():
            for s in family.samples:
                if s.name.endswith(_GROWING):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class LocalStore:
    """Embedded mode: the figures are this process's own."""

    shared = False

    def __init__(self, metrics: Iterable[MetricWrapperBase], started_at: float) -> None:
        self.metrics = tuple(metrics)
        self.started_at = started_at

    def samples(self) -> dict[SampleKey, float]:
        return local_samples(self.metrics)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class RedisStore:
    """Distributed mode: the sum over every process that shares ``prefix`` (module doc)."""

    shared = True

    def __init__(
        self, metrics: Iterable[MetricWrapperBase], *, url: str, prefix: str, interval_s: float, timeout_s: float = 2.0
    ) -> None:
        import redis

        self.metrics = tuple(metrics)
        self.key = f"{prefix}:metrics:samples"
        self.started_key = f"{prefix}:metrics:started_at"
        self.interval_s = interval_s
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self._lock = threading.Lock()
        self._flushed: dict[SampleKey, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start()
        os.register_at_fork(after_in_child=self._after_fork)
        atexit.register(self.close)

    # ------------------------------------------------------------------ flushing

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="millm-metrics-flush", daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        # a forked child (Celery's prefork pool) holds its parent's counts, which the
        # parent sends itself: the child sends only what it counts from now on
        self._lock = threading.Lock()
        self._flushed = local_samples(self.metrics)
        self._stop = threading.Event()
        self._start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - kept for the next flush
                log.warning("metrics_flush_failed", error=repr(exc))

    def flush(self) -> None:
        """Send what each sample grew since the last flush (nothing when nothing did);
        on failure nothing is marked sent, so the next flush sends it."""
        with self._lock:
            now = local_samples(self.metrics)
            grown = {k: v - self._flushed.get(k, 0.0) for k, v in now.items() if v > self._flushed.get(k, 0.0)}
            if not grown:
                return
            pipe = self._client.pipeline(transaction=True)
            pipe.setnx(self.started_key, repr(time.time()))
            for (name, labels), delta in grown.items():
                pipe.hincrbyfloat(self.key, json.dumps([name, labels], separators=(",", ":")), delta)
            pipe.execute()
            self._flushed.update({k: now[k] for k in grown})

    def close(self) -> None:
        self._stop.set()
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - the process is ending
            log.warning("metrics_flush_failed", error=repr(exc))

    # ------------------------------------------------------------------ reading

    @property
    def started_at(self) -> float:
        import redis

        try:
            raw = self._client.get(self.started_key)
        except redis.RedisError:
            raw = None  # read just after samples(): Redis went away in between
        return float(raw) if raw else time.time()

    def samples(self) -> dict[SampleKey, float]:
        """Every process's sums (this one's own growth sent first); ``EngineUnavailable``
        (503) while Redis does not answer, as for admission: the stack's figures are not
        this process's alone (what it counted meanwhile is sent once Redis is back)."""
        import redis

        try:
            self.flush()
            stored = self._client.hgetall(self.key)
        except redis.RedisError as exc:
            raise EngineUnavailable(
                "the stack's metrics are kept in Redis, which does not answer", details={"error": repr(exc)}
            ) from None
        out: dict[SampleKey, float] = {}
        for field, value in stored.items():
            name, labels = json.loads(field)
            out[(name, tuple(tuple(pair) for pair in labels))] = float(value)
        return out


def by_label(samples: dict[SampleKey, float], metric: str, label: str) -> dict[str, float]:
    """A counter's ``_total`` summed by one label."""
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == f"{metric}_total":
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def total(samples: dict[SampleKey, float], metric: str) -> float:
    return sum(v for (name, _), v in samples.items() if name == f"{metric}_total")


def families(metrics: Iterable[MetricWrapperBase], samples: dict[SampleKey, float]) -> list[Any]:
    """Prometheus families of ``metrics`` (their names, help and types) whose samples are
    ``samples``: what the aggregate scrape exposes in place of this process's counters."""
    from prometheus_client.metrics_core import Metric

    out = []
    for metric in metrics:
        for local in metric.collect():
            family = Metric(local.name, local.documentation, local.type)
            prefix = local.name
            picked = [(n, dict(lbl), v) for (n, lbl), v in samples.items() if n.startswith(prefix + "_")]
            # buckets in their "le" order, so a histogram reads as prometheus-client writes it
            picked.sort(key=lambda s: (s[0], sorted((k, v) for k, v in s[1].items() if k != "le"), _le(s[1])))
            for name, labels, value in picked:
                if name[len(prefix) :] in _GROWING:
                    family.add_sample(name, labels, value)
            out.append(family)
    return out


def _le(labels: dict[str, str]) -> float:
    le = labels.get("le")
    return float("inf") if le in (None, "+Inf") else float(le)
