"""OpenTelemetry traces (OTEL_ENABLED; docs/operators.md, "Traces"): a steered /v1 request
is one trace — the view's span and the engine's span of each of its jobs, its child —
both carrying the request's id and the steering hash the response reports. On without
the packages, start-up stops naming the setting. Spans are read with the SDK's in-memory
exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpu_engine.api import tracing
from gpu_engine.api.steering import SteeringEntry, SteeringSpec
from tests.v1.conftest import attach
from tests.v1.helpers import request

BODY = {"model": "tiny-llama", "prompt": "the lighthouse", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def spans():
    from core.tracing import configure

    exporter = InMemorySpanExporter()
    provider = configure(exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


def test_a_steered_request_is_one_trace_from_view_to_engine(llama, spans):
    relu = attach("tiny-llama-L1-relu", 1)
    body = {**BODY, "n": 2, "steering": {"features": [{"index": 3, "strength": 12.0}]}}
    resp = request(llama.base_url, "POST", "/completions", body)
    assert resp.status == 200, resp.body[:300]
    llama.wait_idle()
    expected_hash = SteeringSpec([SteeringEntry(relu.id, 1, {3: 12.0})]).canonical_hash()
    assert resp.json()["millm"]["steering"]["hash"] == expected_hash

    finished = spans.get_finished_spans()
    views = [s for s in finished if s.name == "millm.v1.completion"]
    assert len(views) == 1, [s.name for s in finished]
    view = views[0]
    assert view.attributes["millm.request_id"] == resp.json()["id"]
    assert view.attributes["millm.steering_hash"] == expected_hash
    jobs = [s for s in finished if s.name == "millm.engine.generate"]
    assert len(jobs) == 2  # n=2: two engine jobs, each the view's child, in its trace
    for job in jobs:
        assert job.parent is not None and job.parent.span_id == view.context.span_id
        assert job.context.trace_id == view.context.trace_id
        assert job.attributes["millm.steering_hash"] == expected_hash
        assert job.attributes["millm.request_id"].startswith("cmpl-")
        assert job.attributes["millm.model"] == "tiny-llama"
    assert len({job.attributes["millm.request_id"] for job in jobs}) == 2


def test_on_without_the_packages_stops_start_up(monkeypatch):
    import builtins

    from millm_site.config import ConfigError, load_config

    real_import = builtins.__import__

    def without_otel(name, *args, **kwargs):
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_otel)
    with pytest.raises(ConfigError) as caught:
        load_config({"OTEL_ENABLED": "true"})
    assert caught.value.name == "OTEL_ENABLED"
    assert "requirements/otel.txt" in str(caught.value)
    assert load_config({"OTEL_ENABLED": "false"})["OTEL_ENABLED"] is False
