"""The analyzer registry and what an analysis needs captured (``gpu_engine.analysis``)."""

from gpu_engine.analysis import (
    AnalysisContext,
    Analyzer,
    AnalyzerRegistry,
    CaptureNeed,
    capture_spec_for,
    check_capture,
    default_registry,
    load_extra,
)

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
