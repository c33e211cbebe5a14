"""Backend-neutral per-request decode state: what happens to a request between one
forward pass and the next, whichever backend ran it.

- ``sequence``: ``Sequence``, one request's state (sampler, detokeniser, stop matcher, EOS
  set, logprobs, streaming monitor records, events, ``FinishEvent``);
- ``sampling``: ``Sampler`` (penalties, logit bias, top-k/top-p, a private generator),
  batch row choice and ``score_result``;
- ``text``: incremental detokenisation, stop sequences, a chat template's tool-call format;
- ``grammar``: ``response_format`` and tool calls on xgrammar (``grammar_worker`` is the
  child process that compiles a schema).

Layering: the backends import this package; it imports no backend (an import-linter
contract in ``pyproject.toml``).  Submodules are imported by name: ``grammar`` pulls in
xgrammar, which only a structured request needs.
"""
