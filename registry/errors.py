"""The registry's errors: models, SAEs, jobs, local paths, the hub and downloads."""

from __future__ import annotations

from core.errors import MillmError

# declared beside the engine codes it maps (core.errors); orchestration raises it from here
from core.errors import UnsupportedQuantization as UnsupportedQuantization


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


class AmbiguousModelName(MillmError):
    """A hub repository holds several GGUF quantizations and the name chose none."""

    code, status = "AMBIGUOUS_MODEL_NAME", 400


class SAENotFound(MillmError):
    code, status = "SAE_NOT_FOUND", 404


class SAEAlreadyAttached(MillmError):
    code, status = "SAE_ALREADY_ATTACHED", 409


class SAEAlreadyExists(MillmError):
    """The files at that local path are already registered (details: sae_id)."""

    code, status = "SAE_ALREADY_EXISTS", 409


class JobNotFound(MillmError):
    code, status = "JOB_NOT_FOUND", 404


class JobFinished(MillmError):
    code, status = "JOB_ALREADY_FINISHED", 409


class ModelAlreadyLoaded(MillmError):
    code, status = "MODEL_ALREADY_LOADED", 400


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


class VectorInvalid(MillmError):
    """A steering vector file or its creation arguments were refused; ``details.field``
    names what (``file``, ``layer``, ``model``, ``pairs``)."""

    code, status = "VECTOR_INVALID", 400


class VectorNotFound(MillmError):
    code, status = "VECTOR_NOT_FOUND", 404


class VectorAlreadyExists(MillmError):
    """A steering vector of that name is registered (details: sae_id)."""

    code, status = "VECTOR_ALREADY_EXISTS", 409


class RemoteCodeNotAllowed(MillmError):
    """``trust_remote_code`` asked for where the operator (ALLOW_REMOTE_CODE) or the
    caller's key does not allow it; ``details.field`` and ``details.setting`` name both."""

    code, status = "REMOTE_CODE_NOT_ALLOWED", 400


class InsufficientStorage(MillmError):
    """A download would not fit on the disk of its cache (``details``: bytes needed and
    free), refused before any file is fetched."""

    code, status = "INSUFFICIENT_STORAGE", 507
