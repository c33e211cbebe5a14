"""Per-key quotas and usage (issue 37, part 3; docs/security.md, "Quotas and usage"),
against the live daphne of tests/v1 with three keys and the official ``openai`` client:

- over its requests per minute, requests at once or tokens per minute, a key gets
  ``openai.RateLimitError`` (429 ``rate_limit_exceeded`` with Retry-After) before anything
  runs; another key, and an admin key the limits do not name, are served meanwhile;
- usage rows equal the token counts the answers reported (streamed and not, steered and
  not); an inference key reads only its own usage, an admin key every key's; CSV equals
  JSON; a range past a year is refused;
- the same windows through Redis (the distributed topology's limiter) hold across two
  limiters, as two web processes would share them.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import openai
import pytest

from inference import quotas, usage
from inference.models import KeyUsage
from inference.quota_limits import Limits
from tests.distributed.conftest import redis_port, redis_url  # noqa: F401
from tests.v1.conftest import KEYS, _v1_db, keyed, llama  # noqa: F401
from tests.v1.helpers import request

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
def limits(settings, keyed):  # noqa: F811
    """Set KEY_LIMITS for the live server, with fresh windows for this test."""
    with quotas.replaced(quotas.LocalLimiter()) as limiter:

        def set_limits(table: dict[str, Any]) -> quotas.LocalLimiter:
            settings.KEY_LIMITS = table
            return limiter

        yield set_limits


def _chat(client: Any, **extra: Any) -> Any:
    return client.chat.completions.create(**{**CHAT, **extra})


def _refused(call: Any) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        call()
    error = info.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded", error
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    return error


def _usage_of(owner: str) -> KeyUsage | None:
    usage.flush()
    return KeyUsage.objects.filter(owner=owner).first()


def test_over_requests_per_minute_is_a_429_that_runs_nothing(llama, keyed, limits):  # noqa: F811
    limits({"*": {"rpm": 2}})
    alice, bob, root = keyed["alice"], keyed["bob"], keyed["root"]
    for _ in range(2):
        _chat(alice)
    llama.wait_idle()
    error = _refused(lambda: _chat(alice))
    assert error.body["type"] == "requests" and "requests per min" in error.message and "alice" in error.message
    assert error.response.headers["x-ratelimit-limit-requests"] == "2"
    # the refused request ran nothing: no generation, no usage
    assert llama.engine.status().in_flight == 0
    assert _usage_of("key:alice").requests == 2
    # another key, and the admin key the limits do not name, are served meanwhile
    for _ in range(2):
        _chat(bob)
    _refused(lambda: _chat(bob))
    for _ in range(4):
        _chat(root)
    # every /v1 route that generates counts: completions and responses too
    with pytest.raises(openai.RateLimitError):
        alice.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        alice.responses.create(model="tiny-llama", input="x", max_output_tokens=16)
    # and the /api route that runs on the engine, in the envelope's shape
    resp = request(
        llama.url, "POST", "/api/probes/score", {"inputs": ["x"]}, headers={"Authorization": f"Bearer {KEYS['alice']}"}
    )
    assert resp.status == 429 and resp.json()["error"]["code"] == "RATE_LIMIT_EXCEEDED"
    assert int(resp.headers["retry-after"]) >= 1 and resp.json()["error"]["details"]["limit"] == "rpm"


def test_an_admin_key_named_by_the_limits_is_limited(llama, keyed, limits):  # noqa: F811
    limits({"*": {"rpm": 100}, "root": {"rpm": 1}, "alice": {"rpm": None}})
    _chat(keyed["root"])
    _refused(lambda: _chat(keyed["root"]))
    for _ in range(3):  # null lifts the default for alice
        _chat(keyed["alice"])


def _open_stream(base_url: str, key: str, body: dict[str, Any]) -> socket.socket:
    url = urlparse(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {url.path.rstrip('/')}/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert b" 200 " in received.split(b"\r\n", 1)[0], received
    return sock


def test_over_requests_at_once_is_a_429_until_the_stream_ends(llama, keyed, limits):  # noqa: F811
    limiter = limits({"*": {"concurrent": 1}})
    body = {"model": "tiny-llama", "prompt": "the sea", "max_tokens": 400, "stream": True, "ignore_eos": True}
    sock = _open_stream(llama.base_url, KEYS["alice"], body)
    try:
        assert limiter.used("alice")["concurrent"] == 1
        # refused at once, before the admission queue the stream's slot keeps busy
        error = _refused(lambda: _chat(keyed["alice"]))
        assert "requests at once" in error.message
    finally:
        sock.close()
    deadline = time.monotonic() + 10
    while limiter.used("alice")["concurrent"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert limiter.used("alice")["concurrent"] == 0  # the place came back with the hang-up
    _chat(keyed["alice"])


def test_tokens_per_minute_charge_the_real_count_and_refuse_past_the_limit(llama, keyed, limits):  # noqa: F811
    limiter = limits({"*": {"tpm": 400}})
    alice = keyed["alice"]
    first = _chat(alice, max_tokens=8)
    # admitted on its estimate, charged what it really used once it ended
    assert limiter.used("alice")["tpm"] == first.usage.total_tokens
    spent = first.usage.total_tokens
    refused = None
    for _ in range(40):
        try:
            spent += _chat(alice, max_tokens=8).usage.total_tokens
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None, "never refused"
    assert refused.body["type"] == "tokens" and "tokens per min" in refused.message
    assert limiter.used("alice")["tpm"] == spent <= 400
    estimate = quotas.estimate_tokens(len(json.dumps({**CHAT, "max_tokens": 8})), 8)
    assert spent + estimate > 400 - estimate  # refused near the limit, not early
    _chat(keyed["bob"], max_tokens=8)
    # a request larger than the whole minute's tokens can never pass
    _refused(lambda: _chat(keyed["bob"], max_tokens=1000))


def test_the_limits_hold_through_redis_across_processes(llama, keyed, settings, redis_url):  # noqa: F811
    """The live server on the distributed topology's limiter, with another web process
    (a second limiter on the same Redis) spending the same key's windows."""
    settings.KEY_LIMITS = {"*": {"rpm": 2, "concurrent": 1}}
    limits = Limits(rpm=2, concurrent=1)
    with quotas.replaced(quotas.RedisLimiter(url=redis_url, prefix="h6v1")) as here:
        elsewhere = quotas.RedisLimiter(url=redis_url, prefix="h6v1")
        assert elsewhere.admit_now("alice", limits, 0, "elsewhere") is None
        error = _refused(lambda: _chat(keyed["alice"]))  # its one place is taken over there
        assert "requests at once" in error.message
        elsewhere.release("alice", limits, "elsewhere", 0)
        _chat(keyed["alice"])  # the minute's second request
        assert here.used("alice") == {"rpm": 2, "tpm": 0, "concurrent": 0}
        error = _refused(lambda: _chat(keyed["alice"]))
        assert "requests per min" in error.message
        _chat(keyed["bob"])
        assert elsewhere.used("bob")["rpm"] == 1


def test_staff_rows_override_the_setting_field_by_field(llama, keyed, limits):  # noqa: F811
    from inference.models import KeyLimit

    limits({"*": {"rpm": 100, "concurrent": 4}})
    row = KeyLimit.objects.create(label="alice", rpm=1)
    quotas.read_rows()  # what the admin's save does in its own process (others: within ROWS_REFRESH_S)
    assert quotas.table()["alice"] == {"rpm": 1} and quotas.table()["*"] == {"rpm": 100, "concurrent": 4}
    _chat(keyed["alice"])
    error = _refused(lambda: _chat(keyed["alice"]))
    assert "Limit 1" in error.message
    _chat(keyed["bob"])  # the setting's default still holds for bob
    row.delete()
    quotas.read_rows()
    _chat(keyed["alice"])  # back to the setting's 100 a minute


def test_a_row_limits_with_the_setting_empty(llama, keyed, settings):  # noqa: F811
    from inference.models import KeyLimit

    settings.KEY_LIMITS = {}
    KeyLimit.objects.create(label="*", rpm=1)
    try:
        with quotas.replaced(quotas.LocalLimiter()):
            quotas.read_rows()
            _chat(keyed["bob"])
            _refused(lambda: _chat(keyed["bob"]))
            _chat(keyed["root"])  # admin keys: only a row or entry naming them
    finally:
        KeyLimit.objects.all().delete()
        quotas.read_rows()


def test_no_limits_with_keys_off(llama, settings):  # noqa: F811
    settings.MILLM_API_KEYS, settings.MILLM_ADMIN_API_KEYS = [], []
    settings.KEY_LIMITS = {"*": {"rpm": 1}, "anonymous": {"rpm": 1}}
    with (
        quotas.replaced(quotas.LocalLimiter()) as limiter,
        openai.OpenAI(base_url=llama.base_url, api_key="x", max_retries=0) as client,
    ):
        for _ in range(3):
            _chat(client)
        assert limiter.used("anonymous") == {"rpm": 0, "tpm": 0, "concurrent": 0}
    assert _usage_of("anonymous").requests == 3  # usage is still recorded


def _api_usage(base: str, key: str, query: str = "") -> Any:
    return request(base, "GET", f"/api/usage{query}", None, headers={"Authorization": f"Bearer {key}"})


def test_usage_equals_what_the_answers_reported_and_is_each_keys_own(llama, keyed):  # noqa: F811
    from tests.v1.conftest import attach

    alice, bob = keyed["alice"], keyed["bob"]
    answers = [_chat(alice, max_tokens=4), alice.completions.create(model="tiny-llama", prompt="the sea", max_tokens=5)]
    streamed = list(_chat(alice, stream=True, stream_options={"include_usage": True}))
    answers.append(streamed[-1])
    attach("tiny-llama-L1-relu", 1)
    steered = _chat(alice, max_tokens=3, extra_body={"steering": {"features": [{"index": 0, "strength": 4.0}]}})
    answers.append(steered)
    bobs = _chat(bob, max_tokens=2)
    usage.flush()
    row = KeyUsage.objects.get(owner="key:alice")
    assert row.requests == 4 and row.steered_requests == 1
    assert row.prompt_tokens == sum(a.usage.prompt_tokens for a in answers)
    assert row.completion_tokens == sum(a.usage.completion_tokens for a in answers)
    assert row.day == dt.datetime.now(dt.UTC).date()

    mine = _api_usage(llama.url, KEYS["alice"]).json()["data"]
    assert [r["key"] for r in mine["usage"]] == ["alice"]
    item = mine["usage"][0]
    assert (item["requests"], item["prompt_tokens"], item["completion_tokens"]) == (
        4,
        row.prompt_tokens,
        row.completion_tokens,
    )
    assert item["steered_share"] == 0.25 and mine["totals"]["total_tokens"] == item["total_tokens"]
    # another key's usage: never shown to an inference key
    refused = _api_usage(llama.url, KEYS["alice"], "?key=bob")
    assert refused.status == 403 and refused.json()["error"]["code"] == "FORBIDDEN"
    assert [r["key"] for r in _api_usage(llama.url, KEYS["bob"]).json()["data"]["usage"]] == ["bob"]
    # an admin key sees every key's, and filters
    everyone = _api_usage(llama.url, KEYS["root"]).json()["data"]
    assert {r["key"]: r["completion_tokens"] for r in everyone["usage"]} == {
        "alice": row.completion_tokens,
        "bob": bobs.usage.completion_tokens,
    }
    assert [r["key"] for r in _api_usage(llama.url, KEYS["root"], "?key=bob").json()["data"]["usage"]] == ["bob"]
    today = dt.datetime.now(dt.UTC).date()
    yesterday = (today - dt.timedelta(days=1)).isoformat()
    assert _api_usage(llama.url, KEYS["root"], f"?start={yesterday}&end={yesterday}").json()["data"]["usage"] == []
    # CSV equals JSON
    resp = _api_usage(llama.url, KEYS["root"], "?format=csv")
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(resp.body.decode())))
    assert [{k: str(v) for k, v in r.items()} for r in everyone["usage"]] == rows
    # a range past a year, a bad date or format: 422, nothing read
    for query in ("?start=0001-01-01&end=9999-12-31", "?start=2026-13-01", "?format=../../etc/passwd", "?key=a%20b"):
        bad = _api_usage(llama.url, KEYS["root"], query)
        assert bad.status == 422 and bad.json()["error"]["code"] == "VALIDATION_ERROR", (query, bad.body)
    assert _api_usage(llama.url, KEYS["root"], "?end=0001-01-01").status == 200
    # no key, or a key nobody configured: 401 before anything is read
    for header in ({}, {"Authorization": "Bearer not-a-configured-key"}):
        anon = request(llama.url, "GET", "/api/usage", None, headers=header)
        assert anon.status == 401, (header, anon.body)
        assert b"alice" not in anon.body and b"bob" not in anon.body


def test_the_admin_shows_usage_read_only_and_edits_limits_checked():
    from django.contrib import admin
    from django.core.exceptions import ValidationError

    from inference.models import KeyLimit

    model_admin = admin.site._registry[KeyUsage]
    assert not model_admin.has_add_permission(None)
    assert not model_admin.has_change_permission(None)
    assert not model_admin.has_delete_permission(None)
    assert KeyLimit in admin.site._registry
    for bad in (KeyLimit(label="a b", rpm=1), KeyLimit(label="alice", rpm=0), KeyLimit(label="x", tpm=10**13)):
        with pytest.raises(ValidationError):
            bad.full_clean()
    KeyLimit(label="*", concurrent=2).full_clean()
