"""What one engine process's server is tuned by (``run_engine`` builds it from the
ENGINE_* settings): heartbeat and dead-engine timing, deliveries before a job is
dead-lettered, jobs at once, result lifetime, shutdown grace, the cancel poll and the
bounds of one request's wait and event stream. Read by the server, its delivery checks
and its result writer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    prefix: str = "millm"
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0
    max_deliveries: int = 3
    max_in_flight: int = 1
    result_ttl_s: int = 600
    shutdown_grace_s: float = 30.0
    cancel_poll_s: float = 0.2
    # bounds the wait for a generation's next event, and an embed/score call
    event_timeout_s: float = 600.0
    # approximate cap of one request's event stream (tokens + final)
    stream_maxlen: int = 100_000

    def __post_init__(self) -> None:
        if self.heartbeat_s <= 0 or self.dead_after_s < 2 * self.heartbeat_s:
            raise ValueError("dead_after_s must be at least twice heartbeat_s (and > 0)")
        if self.max_deliveries < 1 or self.max_in_flight < 1:
            raise ValueError("max_deliveries and max_in_flight must be >= 1")

    @property
    def dead_after_ms(self) -> int:
        return max(int(self.dead_after_s * 1000), 1)
