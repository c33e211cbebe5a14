"""The prefix cache through /v1 (PREFIX_CACHE_MAX_MB; docs/engine.md, "Prefix cache"): a
10-turn chat resent whole each turn (as Open WebUI does) through the official client gets
the same greedy answers with the cache as with it off, and /api/health/metrics and the
Prometheus scrape show the hits, per request class."""

from __future__ import annotations

import re

import msgspec
import pytest

from tests.v1.helpers import request

TURNS = 10


def reload_with_cache(server, mb: int | None) -> None:
    """tiny-llama loaded again as the site loads it, with PREFIX_CACHE_MAX_MB = ``mb``
    (None: the site's setting)."""
    from django.conf import settings

    from orchestration.load_checks import load_job
    from registry.models import Model

    job = load_job(Model.objects.get(name="tiny-llama"), device="cpu", dtype="float32")
    assert job.options["prefix_cache_max_mb"] == settings.PREFIX_CACHE_MAX_MB  # the setting travels
    if mb is not None:
        job = msgspec.structs.replace(job, options={**job.options, "prefix_cache_max_mb": mb})
    server.engine.unload_model()
    server.engine.load_model(job)


def chat(openai_client) -> list[str]:
    messages: list[dict] = []
    answers = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"turn {turn}: tell me one more thing about foxes"})
        out = openai_client.chat.completions.create(
            model="tiny-llama", messages=messages, max_tokens=6, temperature=0.0
        )
        answer = out.choices[0].message.content
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


def figures(server) -> dict:
    resp = request(server.url, "GET", "/api/health/metrics")
    assert resp.status == 200, resp.body[:300]
    return resp.json()["data"]["prefix_cache"]


@pytest.fixture
def restored(llama):
    yield llama
    reload_with_cache(llama, None)


def test_a_resent_chat_gets_the_same_answers_and_hits_the_cache(restored, openai_client):
    server = restored
    reload_with_cache(server, 0)
    assert figures(server)["enabled"] is False
    uncached = chat(openai_client)
    reload_with_cache(server, None)
    before = figures(server)
    assert before["enabled"] is True and before["entries"] == 0
    cached = chat(openai_client)
    assert cached == uncached
    after = figures(server)
    unsteered = after["classes"]["unsteered"]
    assert unsteered["lookups"] == TURNS and unsteered["hits"] == TURNS - 1
    assert unsteered["tokens_reused"] > 0 and unsteered["hit_rate"] == pytest.approx((TURNS - 1) / TURNS)
    assert 0 < after["bytes"] <= after["budget_bytes"]
    caps = server.engine.status().batching["capabilities"]
    assert caps["prefix_caching"] is True
    # the same figures in the Prometheus scrape, per class
    text = request(server.url, "GET", "/api/health/metrics/prometheus").body.decode()

    def sample(name: str) -> float:
        m = re.search(rf'^{name}\{{class="unsteered"\}} (\S+)$', text, re.M)
        assert m, name
        return float(m.group(1))

    assert sample("millm_prefix_cache_hits_total") == TURNS - 1
    assert sample("millm_prefix_cache_tokens_reused_total") == unsteered["tokens_reused"]
    assert sample("millm_prefix_cache_hit_rate") == pytest.approx((TURNS - 1) / TURNS)
    assert re.search(r"^millm_prefix_cache_bytes \S+$", text, re.M)
