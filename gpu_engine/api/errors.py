"""``EngineError`` and its codes (see ``gpu_engine.errors``)."""

from gpu_engine.errors import (
    AnalyzerCaptureMissing,
    BackendUnavailable,
    CaptureStoreFull,
    CaptureTooLarge,
    ContextLengthExceeded,
    EngineBusy,
    EngineError,
    EngineShutdown,
    GenerationFailed,
    InsufficientMemory,
    InvalidFeatureIndex,
    InvalidParameter,
    InvalidProbeFile,
    ModelLoadFailed,
    ModelNotLoaded,
    ResponseFormatUnsupported,
    SAEFormatError,
    SAEIncompatible,
    SAENotAttached,
    SchemaTooComplex,
    UnknownAnalyzer,
    UnsupportedArchitecture,
    UnsupportedQuantization,
    error_from_dict,
)

__all__ = [
    "AnalyzerCaptureMissing", "BackendUnavailable", "CaptureStoreFull", "CaptureTooLarge",
    "ContextLengthExceeded", "EngineBusy", "EngineError", "EngineShutdown", "GenerationFailed",
    "InsufficientMemory", "InvalidFeatureIndex", "InvalidParameter", "InvalidProbeFile",
    "ModelLoadFailed", "ModelNotLoaded", "ResponseFormatUnsupported", "SAEFormatError",
    "SAEIncompatible", "SAENotAttached", "SchemaTooComplex", "UnknownAnalyzer",
    "UnsupportedArchitecture", "UnsupportedQuantization", "error_from_dict",
]
