"""The engine's runtime: one resident model and the work on it.

``engine`` is the facade the web tier and ``run_engine`` build (``Engine``), on top of
its worker thread and queue (``worker``), what is resident and how it is loaded,
unloaded, attached to and recovered after an out-of-memory failure (``loading``), and
what it reports (``status``).  Beside it: the batch policy (``scheduler``), the ledger of
accepted work and draining it (``drain``), a generation's events (``stream``), a
request's token ids, budget and hooks (``prepare``) and an attached SAE (``attachments``).

The runtime loads a backend through the registry (``gpu_engine.backends``) and talks to
it through ``gpu_engine.backends.base.ModelBackend`` only: it never names an adapter
(an import-linter contract in pyproject.toml).  Nothing is imported here, so a reader of
one module (the stream, the scheduler) does not pay for the others.
"""
