"""Moved to ``gpu_engine.decode.grammar``.  This re-export keeps the old path working until
its last importer moves."""

from .decode.grammar import (
    GRAMMAR_CACHE_SIZE,
    GRAMMAR_WORKERS,
    WORKER_START_TIMEOUT_S,
    GrammarBuilder,
    Grammars,
    RequestGrammar,
    build_grammar,
    built,
    grammar_for,
    grammar_text,
    remember,
)

__all__ = ["GRAMMAR_CACHE_SIZE", "GRAMMAR_WORKERS", "WORKER_START_TIMEOUT_S", "GrammarBuilder",
           "Grammars", "RequestGrammar", "build_grammar", "built", "grammar_for", "grammar_text",
           "remember"]
