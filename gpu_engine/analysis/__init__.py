"""Analyzers over captured hidden states and attention Q/K (issue 15; the original's mia).

Django-free and torch-free: an analyzer reads a ``gpu_engine.api.artifacts.CaptureData``
(numpy arrays) and returns plain JSON.  ``registry`` holds the names, the capture each
analyzer declares (``CaptureNeed``) and how needs become a ``CaptureSpec``;
``builtin`` the analyzers of the issue (``hidden``, ``attention``, ``probes``: one module
per family, ``common`` what they share), each with its math in a numpy function the tests
check against hand-computed numbers.
"""

from .registry import (
    AnalysisContext,
    Analyzer,
    AnalyzerRegistry,
    CaptureNeed,
    capture_spec_for,
    check_capture,
    load_extra,
)
from .builtin import default_registry

__all__ = [
    "AnalysisContext",
    "Analyzer",
    "AnalyzerRegistry",
    "CaptureNeed",
    "capture_spec_for",
    "check_capture",
    "default_registry",
    "load_extra",
]
