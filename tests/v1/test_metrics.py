"""What /api/health/metrics and the system:metrics event count when real requests arrive:
tokens by the usage the responses report, refusals by reason (one each), and the push to
a real WebSocket client."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from websockets.sync.client import connect

from tests.v1.helpers import assert_openai_error, request

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def metrics(server) -> dict[str, Any]:
    resp = request(server.url, "GET", "/api/health/metrics")
    assert resp.status == 200, resp.body[:300]
    return resp.json()["data"]


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def usage_of_stream(resp) -> dict[str, int]:
    assert resp.status == 200, resp.body[:300]
    events = resp.events()
    assert events[-1] == "[DONE]"
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(usage) == 1
    return usage[0]


def test_tokens_generated_grow_by_the_usage_responses_report(llama):
    before = metrics(llama)
    url = llama.base_url
    usages = [
        request(url, "POST", "/chat/completions", {**CHAT, "n": 2}).json()["usage"],
        # a batch of prompts in one request
        request(
            url,
            "POST",
            "/completions",
            {"model": "tiny-llama", "prompt": ["the sea", "a cat sat"], "max_tokens": 5, "ignore_eos": True},
        ).json()["usage"],
        usage_of_stream(
            request(
                url, "POST", "/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            )
        ),
        usage_of_stream(
            request(
                url,
                "POST",
                "/completions",
                {
                    "model": "tiny-llama",
                    "prompt": "once",
                    "max_tokens": 6,
                    "n": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        ),
    ]
    llama.wait_idle()
    after = metrics(llama)
    completion = sum(u["completion_tokens"] for u in usages)
    assert completion >= 4 + 10 + 1 + 2
    assert after["tokens_generated"] - before["tokens_generated"] == completion
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert grown(before["refusals"], after["refusals"]) == {}


def test_each_refusal_is_counted_once_by_reason(llama, admission):
    before = metrics(llama)["refusals"]
    ctl = admission(slots=1, pending=0)
    held = ctl.try_acquire()
    try:
        assert_openai_error(request(llama.base_url, "POST", "/chat/completions", CHAT), 503, "queue_full")
    finally:
        held.release()

    never = {"X-miLLM-Load-Policy": "refuse"}
    assert_openai_error(
        request(
            llama.base_url,
            "POST",
            "/completions",
            {"model": "tiny-gpt2", "prompt": "x", "max_tokens": 2},
            headers=never,
        ),
        409,
        "model_not_resident",
    )

    from registry.models import Model

    model_id = Model.objects.get(name="tiny-llama").id
    grant = request(
        llama.url,
        "POST",
        f"/api/models/{model_id}/lease",
        {"holder": "metrics-test", "reason": "refusals", "ttl_seconds": 60},
    )
    assert grant.status == 201, grant.body[:300]
    lease_id = grant.json()["data"]["lease_id"]
    try:
        # auto-loading another model would swap out the leased one
        assert_openai_error(
            request(llama.base_url, "POST", "/completions", {"model": "tiny-gpt2", "prompt": "x", "max_tokens": 2}),
            409,
            "model_leased",
        )
        refused = request(llama.url, "POST", f"/api/models/{model_id}/unload")
        assert refused.status == 409 and refused.json()["error"]["code"] == "MODEL_LEASED"
    finally:
        released = request(llama.url, "DELETE", f"/api/models/{model_id}/lease", headers={"X-miLLM-Lease": lease_id})
        assert released.status == 200, released.body[:300]

    # wrong requests are not refusals
    assert_openai_error(
        request(llama.base_url, "POST", "/completions", {"model": "no-such-model", "prompt": "x"}),
        404,
        "model_not_found",
    )
    assert_openai_error(
        request(llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": -1}),
        400,
        "invalid_parameter",
    )

    assert grown(before, metrics(llama)["refusals"]) == {"queue_full": 1, "model_not_resident": 1, "model_leased": 2}


def _metrics_events(ws, until, timeout_s: float = 15.0) -> dict[str, Any]:
    """Read the socket until a system:metrics event satisfies ``until``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        message = json.loads(raw)
        if message["event"] == "system:metrics":
            assert "tell me about the lighthouse" not in raw  # never prompt text
            if until(message["data"]):
                return message["data"]
    raise AssertionError("no system:metrics event matched in time")


def test_websocket_clients_get_system_metrics_pushed(llama, settings):
    from core.runtime import runtime
    from system.metrics import PUSHED_KEYS

    settings.METRICS_PUSH_INTERVAL_S = 0.2
    ws_url = llama.url.replace("http://", "ws://") + "/ws/events"
    with connect(ws_url, open_timeout=10) as ws:
        first = _metrics_events(ws, lambda data: True, timeout_s=5)  # sent on joining
        assert set(first) == set(PUSHED_KEYS)
        assert first["model_loaded"] is True and first["model_name"] == "tiny-llama"
        assert {"in_flight", "waiting"} <= set(first["queue"])
        assert runtime().metrics_push.running

        body = {
            "model": "tiny-llama",
            "max_tokens": 5,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell me about the lighthouse"}],
        }
        usage = request(llama.base_url, "POST", "/chat/completions", body).json()["usage"]
        expected = first["tokens_generated"] + usage["completion_tokens"]
        seen = _metrics_events(ws, lambda data: data["tokens_generated"] >= expected)
        assert seen["tokens_generated"] == expected
        assert seen["tokens_generated"] == metrics(llama)["tokens_generated"]

    deadline = time.monotonic() + 5
    while runtime().metrics_push.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not runtime().metrics_push.running  # the last client left: the push stops


def test_no_push_when_the_interval_is_zero(llama, settings):
    from core.runtime import runtime

    settings.METRICS_PUSH_INTERVAL_S = 0
    ws_url = llama.url.replace("http://", "ws://") + "/ws/events"
    with connect(ws_url, open_timeout=10) as ws:
        with pytest.raises(TimeoutError):
            ws.recv(timeout=1.0)
        assert not runtime().metrics_push.running


def test_engine_figures_count_real_generations(llama):
    """The engine's own figures (docs/operators.md, "Metrics"): a generation of six tokens
    is six tokens, a prefill and five timed decode steps, in the JSON and the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    before = metrics(llama)["engines"]
    assert [e["engine"] for e in before] == ["default"]
    body = {**CHAT, "max_tokens": 6, "ignore_eos": True}
    usage = request(llama.base_url, "POST", "/chat/completions", body).json()["usage"]
    assert usage["completion_tokens"] == 6
    llama.wait_idle()
    after = metrics(llama)["engines"][0]
    was = before[0]
    assert after["state"] == "ready" and after["model_name"] == "tiny-llama"
    assert after["generated_tokens_total"] - was["generated_tokens_total"] == 6
    assert after["decode_steps"] - was["decode_steps"] == 5
    assert after["step_seconds_last"] > 0
    assert after["decode_seconds_total"] > was["decode_seconds_total"]
    assert after["step_seconds_mean"] == pytest.approx(after["decode_seconds_total"] / after["decode_steps"], rel=1e-3)
    assert after["running"] == 0 and after["occupancy"] == 0 and after["queue_depth"] == 0

    text = request(llama.url, "GET", "/api/health/metrics/prometheus").body
    scraped = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text if isinstance(text, str) else text.decode())
        for s in family.samples
    }
    label = (("engine", "default"),)
    assert scraped[("millm_engine_generated_tokens_total", label)] == after["generated_tokens_total"]
    assert scraped[("millm_engine_batch_occupancy", label)] == 0
