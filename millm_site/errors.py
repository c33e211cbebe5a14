"""Domain errors shared by every surface.

Each error class carries the stable ``code`` of the documented contract and its HTTP
status; the /api envelope and the /v1 OpenAI shape are both built from these in one place
each, so a service raises the same exception whichever surface called it.
"""

from __future__ import annotations

from typing import Any, ClassVar


class MillmError(Exception):
    code: ClassVar[str] = "INTERNAL_ERROR"
    status: ClassVar[int] = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})
        self.retry_after = retry_after


class ValidationFailed(MillmError):
    code, status = "VALIDATION_ERROR", 422


class InvalidLocalPath(MillmError):
    code, status = "INVALID_LOCAL_PATH", 400


class ModelNotFound(MillmError):
    code, status = "MODEL_NOT_FOUND", 404


class ModelAlreadyExists(MillmError):
    code, status = "MODEL_ALREADY_EXISTS", 409


class ModelLocked(MillmError):
    code, status = "MODEL_LOCKED", 409


class ModelLoaded(MillmError):
    code, status = "MODEL_LOADED", 409


class ModelInvalid(MillmError):
    """The files are there but are not a model we can read."""

    code, status = "MODEL_INVALID", 400


class SAENotFound(MillmError):
    code, status = "SAE_NOT_FOUND", 404


class SAEInvalid(MillmError):
    code, status = "SAE_INVALID", 400


class SAEAlreadyAttached(MillmError):
    code, status = "SAE_ALREADY_ATTACHED", 409


class JobNotFound(MillmError):
    code, status = "JOB_NOT_FOUND", 404


class JobFinished(MillmError):
    code, status = "JOB_ALREADY_FINISHED", 409


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


class ModelAlreadyLoaded(MillmError):
    code, status = "MODEL_ALREADY_LOADED", 400


class UnsupportedQuantization(MillmError):
    code, status = "UNSUPPORTED_QUANTIZATION", 400


# --- the hub and downloads --------------------------------------------------------------

class RepoNotFound(MillmError):
    code, status = "REPO_NOT_FOUND", 404


class RevisionNotFound(MillmError):
    code, status = "REVISION_NOT_FOUND", 404


class FileNotFoundOnHub(MillmError):
    code, status = "FILE_NOT_FOUND", 404


class GatedModelNoToken(MillmError):
    code, status = "GATED_MODEL_NO_TOKEN", 401


class InvalidHFToken(MillmError):
    code, status = "INVALID_HF_TOKEN", 401


class HubUnavailable(MillmError):
    """The hub cannot be reached, or its circuit breaker is open (Retry-After set)."""

    code, status = "HUB_UNAVAILABLE", 503


class DownloadFailed(MillmError):
    code, status = "DOWNLOAD_FAILED", 502


class DownloadCancelled(MillmError):
    code, status = "DOWNLOAD_CANCELLED", 499


class DownloadTimedOut(MillmError):
    code, status = "DOWNLOAD_TIMEOUT", 504


class CircuitNotFound(MillmError):
    code, status = "CIRCUIT_NOT_FOUND", 404


class NotReady(MillmError):
    code, status = "NOT_READY", 503


# Engine error codes (gpu_engine.errors) -> the management contract's error classes.
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
}


def from_engine_error(exc: Exception) -> MillmError:
    """The domain error for an engine error (by its stable code); unknown codes are 500s."""
    code = getattr(exc, "code", "engine_error")
    cls = _ENGINE_CODES.get(code, MillmError)
    details = dict(getattr(exc, "details", {}) or {})
    return cls(getattr(exc, "message", str(exc)), details={"engine_code": code, **details})
