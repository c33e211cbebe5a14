"""The engine process and its Redis Streams transport (distributed mode).

Framework-free: redis-py and the protocol structs only, no Django and no torch at
import time (the web tier imports ``keys`` and ``wire`` to talk to the engine).

- ``keys``: every Redis key and stream name, under one prefix.
- ``wire``: the JSON envelope (a command of ``gpu_engine.api.commands`` by name, its
  arguments, its deadline) and the events that travel on the streams (never pickle).
- ``server``: ``EngineServer``, the main loop that a ``run_engine`` process runs around
  an ``Engine``: consumer-group reads with bounded concurrency, acknowledgement only once
  the result is stored, "started" markers so nothing is generated twice, reclaiming and
  dead-lettering the work of a dead engine, heartbeat, cancellation and clean shutdown.
- ``results``: what the engine writes back (a request's events, its final result stored
  with the job's acknowledgement in one MULTI, dead-letter records).
- ``ownership``: one engine per prefix (the owner key, refreshed with the heartbeat in
  one step, given back on close).

docs/deploy.md describes the delivery semantics in full.
"""

from .keys import Keys
from .wire import Envelope, decode_event, encode_event

__all__ = ["Envelope", "Keys", "decode_event", "encode_event"]
