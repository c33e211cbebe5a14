"""Moved to ``gpu_engine.decode.text``.  This re-export keeps the old path working until its
last importer moves."""

from .decode.text import IncrementalDetokenizer, StopMatcher, tool_template_format

__all__ = ["IncrementalDetokenizer", "StopMatcher", "tool_template_format"]
