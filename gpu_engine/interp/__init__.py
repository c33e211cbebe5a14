"""Backend-neutral steering, monitoring and capture (issue 32).

A backend says *where*: a view of the rows at a named place (its hook points) and which
rows belong to which request.  This package says *what*, once for every backend:

- ``plans``: a request's plan — the driver's checks (attachments, feature indices,
  windows, encoders) and the tensors built from the SAEs (deltas, control tables,
  monitors), the same builder on the engine's process and on vLLM's workers;
- ``rows``: the row router — slots, per-attachment delta and control tables, the
  ``BatchContext`` of one forward and the counts of what it applied;
- ``hooks``, ``controls``, ``capture``: the hooks that read and write the rows.

It imports no backend, runtime or server (an import-linter contract).
"""
