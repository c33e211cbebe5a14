"""Moved to ``gpu_engine.decode.sequence`` (backend-neutral; vLLM and llama.cpp use it too).
This re-export keeps the old path working until its last importer moves."""

from ...decode.sequence import Emit, Sequence, prompt_top_entries, structured_grammar, token_logprob

__all__ = ["Emit", "Sequence", "prompt_top_entries", "structured_grammar", "token_logprob"]
