"""The analyzers of issue 15, as the original (mia) defines them, one module per family:
``hidden`` (hidden states, reduced), ``attention`` (Attention Tracker, CoRe, AttnLink-U
over captured Q/K) and ``probes`` (H-Node and science-hallucination probe files over
hidden states). This module holds the list of them and the registry that serves them.
"""

from __future__ import annotations

from .attention import AttentionTracker, AttnLinkU, CoReReranker
from .hidden import HiddenStates
from .probes import HNodeHallucination, ScienceHallucination
from .registry import AnalyzerRegistry

BUILTIN = (
    HiddenStates(),
    AttentionTracker(),
    HNodeHallucination(),
    ScienceHallucination(),
    CoReReranker(),
    AttnLinkU(),
)


def default_registry() -> AnalyzerRegistry:
    """A registry holding the built-in analyzers (here, not in ``registry``, which the
    analyzers import)."""
    reg = AnalyzerRegistry()
    for analyzer in BUILTIN:
        reg.register(analyzer)
    return reg
