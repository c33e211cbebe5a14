"""Domain errors shared by every surface.

Each error class carries the stable ``code`` of the documented contract and its HTTP
status; the /api envelope and the /v1 OpenAI shape are both built from these in one place
each, so a service raises the same exception whichever surface called it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import structlog
from django.conf import settings

log = structlog.get_logger(__name__)


class MillmError(Exception):
    code: ClassVar[str] = "INTERNAL_ERROR"
    status: ClassVar[int] = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})
        self.retry_after = retry_after


class Forbidden(MillmError):
    """An inference key asked for what only an admin key may do (core.auth)."""

    code, status = "FORBIDDEN", 403


class ValidationFailed(MillmError):
    code, status = "VALIDATION_ERROR", 422


class SAEInvalid(MillmError):
    code, status = "SAE_INVALID", 400


class ModelNotLoaded(MillmError):
    code, status = "MODEL_NOT_LOADED", 400


class ModelBusy(MillmError):
    code, status = "MODEL_BUSY", 503


class ModelLoadFailed(MillmError):
    code, status = "MODEL_LOAD_FAILED", 500


class UnsupportedModel(MillmError):
    code, status = "UNSUPPORTED_MODEL", 400


class InsufficientMemory(MillmError):
    code, status = "INSUFFICIENT_MEMORY", 507


class SAEIncompatible(MillmError):
    code, status = "SAE_INCOMPATIBLE", 400


class SAENotAttached(MillmError):
    code, status = "SAE_NOT_ATTACHED", 400


class InvalidFeatureIndex(MillmError):
    code, status = "INVALID_FEATURE_INDEX", 400


class EngineUnavailable(MillmError):
    code, status = "ENGINE_UNAVAILABLE", 503


class NotReady(MillmError):
    code, status = "NOT_READY", 503


class ContextLengthExceeded(MillmError):
    code, status = "CONTEXT_LENGTH_EXCEEDED", 400


class GenerationFailed(MillmError):
    code, status = "GENERATION_FAILED", 500


class BackendUnavailable(MillmError):
    """The model's backend is not installed on the engine's host (details: install)."""

    code, status = "BACKEND_UNAVAILABLE", 400


class CaptureTooLarge(MillmError):
    """A capture whose worst case exceeds CAPTURE_MAX_BYTES (details: estimate_bytes)."""

    code, status = "CAPTURE_TOO_LARGE", 400


class CaptureStoreFull(MillmError):
    """Stored captures fill CAPTURE_DIR_MAX_BYTES (details: estimate_bytes, room_bytes)."""

    code, status = "CAPTURE_STORE_FULL", 507


class UnknownAnalyzer(MillmError):
    """An analyzer name the registry does not have (details: known)."""

    code, status = "UNKNOWN_ANALYZER", 400


class AnalyzerCaptureMissing(MillmError):
    """The capture an analyzer reads was not taken (details: missing)."""

    code, status = "ANALYZER_CAPTURE_MISSING", 400


class InvalidProbeFile(MillmError):
    code, status = "INVALID_PROBE_FILE", 400


class ResponseFormatUnsupported(MillmError):
    """A response_format schema outside the supported subset (details: param, reason)."""

    code, status = "RESPONSE_FORMAT_UNSUPPORTED", 400


class SchemaTooComplex(MillmError):
    """A schema whose grammar was not built within STRUCTURED_COMPILE_TIMEOUT_S (details:
    param, timeout_s)."""

    code, status = "SCHEMA_TOO_COMPLEX", 400


class UnsupportedQuantization(MillmError):
    """A load at a quantization this build cannot run (Q2), or of a pre-quantized
    checkpoint whose method the engine's host cannot load."""

    code, status = "UNSUPPORTED_QUANTIZATION", 400


# Engine error codes (gpu_engine.api.errors) -> the domain error classes: the one table every
# surface goes through (/api answers the class's code; /v1 maps that code in
# inference.errors).
_ENGINE_CODES: dict[str, type[MillmError]] = {
    "model_not_loaded": ModelNotLoaded,
    "model_load_failed": ModelLoadFailed,
    "unsupported_architecture": UnsupportedModel,
    "sae_format_error": SAEInvalid,
    "sae_incompatible": SAEIncompatible,
    "sae_not_attached": SAENotAttached,
    "invalid_feature_index": InvalidFeatureIndex,
    "insufficient_memory": InsufficientMemory,
    "engine_busy": ModelBusy,
    "engine_shutdown": EngineUnavailable,
    "invalid_parameter": ValidationFailed,
    "context_length_exceeded": ContextLengthExceeded,
    "generation_failed": GenerationFailed,
    "backend_unavailable": BackendUnavailable,
    "capture_too_large": CaptureTooLarge,
    "capture_store_full": CaptureStoreFull,
    "unknown_analyzer": UnknownAnalyzer,
    "analyzer_capture_missing": AnalyzerCaptureMissing,
    "invalid_probe_file": InvalidProbeFile,
    "response_format_unsupported": ResponseFormatUnsupported,
    "schema_too_complex": SchemaTooComplex,
    "unsupported_quantization": UnsupportedQuantization,
}


def from_engine_error(exc: Exception, *, no_engine: type[MillmError] | None = None) -> MillmError:
    """The domain error for an engine error (by its stable code); an unknown code is a 500
    that keeps the engine's code, upper-cased. ``model_not_loaded`` raised because no
    engine is serving (``details.engine``: no heartbeat, or restoring / stopping) is
    ``no_engine`` — /api's 503 ENGINE_UNAVAILABLE by default; /v1 keeps its own
    ``model_not_loaded`` (docs/deploy.md, "Submitting")."""
    from django.conf import settings

    code = getattr(exc, "code", "engine_error")
    details = dict(getattr(exc, "details", {}) or {})
    cls = _ENGINE_CODES.get(code)
    if code == "model_not_loaded" and details.get("engine"):
        cls = no_engine or EngineUnavailable
    error = (cls or MillmError)(getattr(exc, "message", str(exc)), details={"engine_code": code, **details})
    if cls is None:
        error.code = code.upper()  # type: ignore[misc]
    if code == "engine_busy" and details.get("reason") == "unloading":
        error.retry_after = int(settings.RETRY_AFTER_UNLOAD_S)  # refused or stopped by it
    if cls is EngineUnavailable and error.retry_after is None:
        error.retry_after = int(settings.RETRY_AFTER_NOT_LOADED_S)
    return error


def retry_after_value(status_code: int, retry_after: int | None, code: str) -> int | None:
    """The Retry-After of an answer: required on 503 (defaulted and logged when missing).
    Here, not in core.api, because core.metrics' middleware applies it too."""
    if retry_after is not None:
        return max(1, int(retry_after))
    if status_code == 503:
        log.warning("retry_after_defaulted", code=code)
        return int(settings.RETRY_AFTER_FALLBACK_S)
    return None
