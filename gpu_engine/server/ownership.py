"""One engine per prefix: the owner key an engine claims (waiting, bounded, for a dead
one's claim to lapse), refreshes with every heartbeat and gives back when it stops.

The refresh and the heartbeat write are one step (a Lua script): an engine that lost the
prefix to another (it stalled past ENGINE_DEAD_AFTER_S) must not overwrite the new one's
status."""

from __future__ import annotations

import time

import redis

from ..api.transport import Keys

_HEARTBEAT_LUA = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not owner then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  return 0
end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return 1
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
"""


class EngineAlreadyRunning(RuntimeError):
    """Another live engine serves this prefix."""


class PrefixOwnership:
    """``engine_id``'s claim on ``keys``' prefix (the owner key, with a TTL of
    ``dead_after_ms``) and the heartbeat written under it."""

    def __init__(self, client: redis.Redis, keys: Keys, engine_id: str, *, dead_after_ms: int) -> None:
        self.redis = client
        self.keys = keys
        self.engine_id = engine_id
        self.dead_after_ms = dead_after_ms
        self._heartbeat = client.register_script(_HEARTBEAT_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    def acquire(self, wait_s: float, *, poll_s: float) -> None:
        """Become the one engine of this prefix, waiting (bounded) for a dead one's claim
        to expire; raise EngineAlreadyRunning if another engine is still alive."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.redis.set(self.keys.owner, self.engine_id, nx=True, px=self.dead_after_ms):
                return
            holder = self.redis.get(self.keys.owner)
            if time.monotonic() >= deadline:
                raise EngineAlreadyRunning(
                    f"engine {holder!r} is serving the prefix {self.keys.prefix!r}; one "
                    "engine per prefix (set ENGINE_STREAM_PREFIX to run another)"
                )
            time.sleep(poll_s)

    def beat(self, payload: str) -> bool:
        """Refresh the claim and write the heartbeat; False when another engine owns the
        prefix now (nothing written)."""
        return bool(
            self._heartbeat(
                keys=[self.keys.owner, self.keys.heartbeat], args=[self.engine_id, self.dead_after_ms, payload]
            )
        )

    def release(self) -> None:
        """Give the prefix back (owner and heartbeat keys), if it is still ours."""
        self._release(keys=[self.keys.owner, self.keys.heartbeat], args=[self.engine_id])


__all__ = ["EngineAlreadyRunning", "PrefixOwnership"]
