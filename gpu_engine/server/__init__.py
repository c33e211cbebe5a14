"""The engine process and its Redis Streams transport (distributed mode).

Framework-free: redis-py and the protocol structs only, no Django and no torch at
import time.  What travels on the streams and the keys' names (the JSON envelope, the
events, ``Keys``) are ``gpu_engine.api.transport``, which the web tier's client speaks too.

- ``server``: ``EngineServer``, the main loop that a ``run_engine`` process runs around
  an ``Engine``: consumer-group reads with bounded concurrency, acknowledgement only once
  the result is stored, "started" markers so nothing is generated twice, reclaiming and
  dead-lettering the work of a dead engine, heartbeat, cancellation and clean shutdown.
- ``delivery``: which entries the server read may run (decoding, the deliveries and
  started-marker checks, reclaiming a dead engine's entries).
- ``config``: ``ServerConfig``, the server's timing and bounds.
- ``results``: what the engine writes back (a request's events, its final result stored
  with the job's acknowledgement in one MULTI, dead-letter records).
- ``ownership``: one engine per prefix (the owner key, refreshed with the heartbeat in
  one step, given back on close).

docs/deploy.md describes the delivery semantics in full.
"""
