"""Per-key quota windows shared through Redis (inference.quotas.RedisLimiter): every web
process of the distributed topology admits against the same windows, so a key's limit
holds however its requests are spread over the workers. Two limiters here, and a third
in a child process, share one Redis database."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from inference.quota_limits import Limits
from inference.quotas import RedisLimiter
from tests.distributed.conftest import REPO


@pytest.fixture
def pair(redis_url):
    return RedisLimiter(url=redis_url, prefix="h6test"), RedisLimiter(url=redis_url, prefix="h6test")


def test_requests_per_minute_hold_across_processes(pair, redis_url):
    one, two = pair
    limits = Limits(rpm=3)
    # a child process (another web worker) spends one request of alice's minute
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from inference.quotas import RedisLimiter; from inference.quota_limits import Limits; "
            f"print(RedisLimiter(url={redis_url!r}, prefix='h6test').admit_now('alice', Limits(rpm=3), 0, 'c1'))",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "MILLM_ENV_FILE": "/nonexistent/.env"},
    )
    assert child.returncode == 0 and child.stdout.strip() == "None", child.stderr
    assert asyncio.run(one.admit("alice", limits, 0, "a")) is None
    assert two.admit_now("alice", limits, 0, "b") is None
    refused = asyncio.run(one.admit("alice", limits, 0, "c"))
    assert refused is not None and refused.limit == "rpm" and refused.used == 3
    assert 55 <= refused.retry_after_s <= 60  # the minute started with the child's request
    assert two.admit_now("alice", limits, 0, "d").limit == "rpm"
    assert two.admit_now("bob", limits, 0, "e") is None  # another key's window
    assert one.used("alice")["rpm"] == two.used("alice")["rpm"] == 3


def test_requests_at_once_and_tokens_are_shared_and_given_back(pair):
    one, two = pair
    limits = Limits(tpm=100, concurrent=2)
    assert one.admit_now("alice", limits, 40, "t1") is None
    assert two.admit_now("alice", limits, 40, "t2") is None
    assert one.admit_now("alice", limits, 1, "t3").limit == "concurrent"
    two.release("alice", limits, "t2", -30)  # it used 10 of its 40
    assert one.used("alice") == {"rpm": 0, "tpm": 50, "concurrent": 1}
    refused = two.admit_now("alice", limits, 60, "t4")
    assert refused is not None and refused.limit == "tpm" and (refused.used, refused.requested) == (50, 60)
    assert two.admit_now("alice", limits, 50, "t5") is None

    # a release from an event loop (a non-streamed answer) is sent without waiting on it
    async def release_on_loop() -> None:
        one.release("alice", limits, "t1", -40)
        await asyncio.sleep(0.2)

    asyncio.run(release_on_loop())
    assert two.used("alice") == {"rpm": 0, "tpm": 60, "concurrent": 1}


def test_a_dead_processes_place_comes_back_after_its_lease(pair, monkeypatch):
    import inference.quotas as quotas

    one, two = pair
    monkeypatch.setattr(quotas, "CONCURRENT_LEASE_MS", 300)
    limits = Limits(concurrent=1)
    assert one.admit_now("alice", limits, 0, "held-by-a-dead-process") is None
    assert two.admit_now("alice", limits, 0, "x").limit == "concurrent"
    time.sleep(0.4)
    assert two.admit_now("alice", limits, 0, "x") is None


def test_an_unreachable_redis_is_a_503():
    from core.errors import EngineUnavailable

    dead = RedisLimiter(url="redis://127.0.0.1:1/0", prefix="h6test", timeout_s=0.2)
    with pytest.raises(EngineUnavailable):
        dead.admit_now("alice", Limits(rpm=1), 0, "a")
