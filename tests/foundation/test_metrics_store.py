"""The stack's counters in Redis (core.metrics_store; distributed mode): two processes'
counts are summed, a sum never goes down, and while Redis does not answer a read is a 503
``ENGINE_UNAVAILABLE`` that loses nothing — what was counted meanwhile is in the sums once
Redis is back. Each "process" here is a store over counters of its own registry, on the
test Redis (127.0.0.1:6379) under a prefix of its own."""

from __future__ import annotations

import secrets
import socket

import pytest
import redis
from prometheus_client import CollectorRegistry, Counter, Histogram

from core.errors import EngineUnavailable
from core.metrics_store import RedisStore, by_label, total

REDIS_URL = "redis://127.0.0.1:6379/0"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefix():
    name = f"metricstest{secrets.token_hex(4)}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError:
        pytest.fail("the test Redis at 127.0.0.1:6379 does not answer")
    yield name
    client.delete(f"{name}:metrics:samples", f"{name}:metrics:started_at")
    client.close()


def _process(prefix: str, url: str = REDIS_URL):
    registry = CollectorRegistry()
    requests = Counter("t_requests", "requests", ["code"], registry=registry)
    seconds = Histogram("t_seconds", "seconds", buckets=(0.1, 1.0), registry=registry)
    store = RedisStore([requests, seconds], url=url, prefix=prefix, interval_s=3600)
    return requests, seconds, store


def test_two_processes_are_summed_and_a_read_during_an_outage_is_a_503_that_loses_nothing(prefix):
    a_requests, a_seconds, a = _process(prefix)
    b_requests, _, b = _process(prefix, url=f"redis://127.0.0.1:{_closed_port()}/0")
    a_requests.labels(code="200").inc(3)
    a_seconds.observe(0.05)
    a_seconds.observe(0.5)
    b_requests.labels(code="200").inc(2)
    b_requests.labels(code="503").inc()

    with pytest.raises(EngineUnavailable) as caught:
        b.samples()
    assert caught.value.status == 503
    sums = a.samples()  # b's counts have not reached Redis: a reports its own only
    assert by_label(sums, "t_requests", "code") == {"200": 3.0}

    b._client = redis.Redis.from_url(REDIS_URL, decode_responses=True)  # Redis is back for b
    for store in (b, a):  # b sends its counts as it reads (its flusher would within the interval)
        sums = store.samples()
        assert by_label(sums, "t_requests", "code") == {"200": 5.0, "503": 1.0}
        assert total(sums, "t_requests") == 6.0
        assert sums[("t_seconds_count", ())] == 2.0
        assert sums[("t_seconds_bucket", (("le", "0.1"),))] == 1.0
        assert sums[("t_seconds_bucket", (("le", "1.0"),))] == 2.0
        assert sums[("t_seconds_sum", ())] == pytest.approx(0.55)

    # a process that starts again counts from 0; the sums keep what it sent before
    c_requests, _, c = _process(prefix)
    c_requests.labels(code="200").inc()
    assert by_label(c.samples(), "t_requests", "code") == {"200": 6.0, "503": 1.0}
    for store in (a, b, c):
        store._stop.set()
