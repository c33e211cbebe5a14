"""Batch API lines against their key's quotas (docs/operators.md, "Quotas and usage"):
a line counts against its batch owner's requests and tokens per minute — the windows the
key's /v1 requests use — and is charged the tokens it used; over a limit it waits (back in
the queue, the batch paused until the window frees) and is never answered with a 429; the
key's concurrent limit does not apply to its lines.

The windows are the real ``LocalLimiter``'s on a clock the test moves: once a line has
been seen waiting, the clock is put a minute on, so the window frees without the test
waiting a minute (and the runner's pause is cut to a second, so it tries again soon)."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from batches import services as batch_services
from batches.models import Batch
from inference import quotas
from tests.v1.conftest import keyed, llama  # noqa: F401
from tests.v1.test_batches import batch_server, chat_line, output, upload, wait_status  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


class ShiftedClock(quotas.LocalLimiter):
    """The real limiter, its clock ``offset_ms`` off the monotonic one."""

    offset_ms = 0.0

    def _now_ms(self) -> float:  # type: ignore[override]
        return time.monotonic() * 1000 + self.offset_ms


@pytest.fixture
def requeued(monkeypatch):
    """Set when the runner puts a line back in the queue (a line that waits)."""
    seen = threading.Event()
    real = batch_services.batch_line_requeue

    def record(**kwargs):
        seen.set()
        return real(**kwargs)

    monkeypatch.setattr(batch_services, "batch_line_requeue", record)
    return seen


def _batch(client, n: int):
    rows = [chat_line(i) for i in range(n)]
    return client.batches.create(
        input_file_id=upload(client, rows).id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def test_a_line_over_its_keys_minute_waits_then_runs_and_is_charged(
    batch_server, keyed, settings, requeued, monkeypatch
):  # noqa: F811
    from batches import runner

    monkeypatch.setattr(runner, "MAX_PAUSE_S", 1.0)
    alice = keyed["alice"]
    with quotas.replaced(ShiftedClock()) as limiter:
        settings.KEY_LIMITS = {"alice": {"rpm": 3, "tpm": 100_000}}
        for _ in range(3):  # alice's minute is full ...
            alice.chat.completions.create(**CHAT)
        with pytest.raises(openai.RateLimitError):
            alice.chat.completions.create(**CHAT)

        batch = _batch(alice, 2)
        assert requeued.wait(60), "no line was put back in the queue"
        waiting = alice.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts.completed == 0
        assert waiting.request_counts.failed == 0
        assert limiter.used("alice")["rpm"] == 3  # a line that waits is not counted

        limiter.offset_ms = 61_000  # ... until a minute has passed
        done = wait_status(alice, batch.id, ("completed", "failed", "expired"), timeout_s=120)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 0)
        lines = output(alice, done.output_file_id)
        assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in lines), lines
        # the new minute holds the two lines, charged the tokens they report using
        used = limiter.used("alice")
        assert used["rpm"] == 2
        assert used["tpm"] == sum(x["response"]["body"]["usage"]["total_tokens"] for x in lines)
        assert Batch.objects.get(id=batch.id).runner is None


def test_a_keys_concurrent_limit_does_not_hold_its_batch_back(batch_server, keyed, settings, requeued):  # noqa: F811
    alice = keyed["alice"]
    with quotas.replaced(quotas.LocalLimiter()) as limiter:
        settings.KEY_LIMITS = {"alice": {"concurrent": 1}}
        done = wait_status(alice, _batch(alice, 3).id, ("completed", "failed", "expired"), timeout_s=120)
        assert done.status == "completed" and done.request_counts.completed == 3, done
        assert not requeued.is_set()
        assert limiter.used("alice") == {"rpm": 0, "tpm": 0, "concurrent": 0}


def test_a_line_of_a_key_without_limits_is_not_counted(batch_server, keyed, settings):  # noqa: F811
    bob = keyed["bob"]
    with quotas.replaced(quotas.LocalLimiter()) as limiter:
        settings.KEY_LIMITS = {"alice": {"rpm": 1}}
        done = wait_status(bob, _batch(bob, 2).id, ("completed", "failed", "expired"), timeout_s=120)
        assert done.status == "completed" and done.request_counts.completed == 2, done
        assert limiter.used("bob") == {"rpm": 0, "tpm": 0, "concurrent": 0}
