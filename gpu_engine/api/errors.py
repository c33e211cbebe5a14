"""Engine errors: one exception class per stable ``code``.

Every error carries ``code`` (stable, snake_case, what clients switch on), a human
message and ``details`` (plain JSON values).  ``to_dict``/``error_from_dict`` let an error
cross a process boundary (Redis Streams) and be re-raised as the same class on the other
side, so the web tier maps codes to HTTP statuses in one place without importing torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

_REGISTRY: dict[str, type[EngineError]] = {}


class EngineError(Exception):
    """Base class; subclasses set ``code``."""

    code: ClassVar[str] = "engine_error"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code")
        if code is None:
            return
        if code in _REGISTRY:
            raise TypeError(f"duplicate engine error code {code!r}")
        _REGISTRY[code] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


_REGISTRY[EngineError.code] = EngineError


def error_from_dict(data: dict[str, Any]) -> EngineError:
    """Rebuild the error class named by ``data['code']`` (unknown codes keep their code)."""
    code = str(data.get("code") or EngineError.code)
    message = str(data.get("message") or code)
    details = dict(data.get("details") or {})
    cls = _REGISTRY.get(code)
    if cls is None:
        err = EngineError(message, details=details)
        err.code = code  # type: ignore[misc]  # keep the foreign code visible
        return err
    err = cls.__new__(cls)
    EngineError.__init__(err, message, details=details)
    return err


class InvalidParameter(EngineError):
    code = "invalid_parameter"

    def __init__(self, message: str, *, param: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details={"param": param, **(details or {})})

    @property
    def param(self) -> str:
        return str(self.details.get("param", ""))


class ContextLengthExceeded(EngineError):
    code = "context_length_exceeded"

    def __init__(self, *, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        super().__init__(
            f"This model's maximum context length is {context_length} tokens; the request "
            f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens "
            f"({prompt_tokens + max_tokens} in total).",
            details={
                "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens,
                "context_length": context_length,
            },
        )


class CaptureTooLarge(EngineError):
    """A capture whose worst-case size (every row it may take) exceeds the limit it was
    sent with (``CAPTURE_MAX_BYTES``); refused before anything runs."""

    code = "capture_too_large"

    def __init__(self, *, estimate_bytes: int, max_bytes: int, rows: int, layers: int) -> None:
        super().__init__(
            f"the capture would take up to {estimate_bytes} bytes ({rows} rows x {layers} layers), "
            f"more than the limit of {max_bytes} bytes: capture fewer layers or positions, or "
            f"ask for fewer tokens",
            details={
                "param": "capture",
                "estimate_bytes": estimate_bytes,
                "max_bytes": max_bytes,
                "rows": rows,
                "layers": layers,
            },
        )


class CaptureStoreFull(EngineError):
    """A capture that could be stored (its worst case above the inline limit) and would
    pass the room left under the capture directory's quota (``CAPTURE_DIR_MAX_BYTES``);
    refused before anything runs."""

    code = "capture_store_full"

    def __init__(self, *, estimate_bytes: int, room_bytes: int) -> None:
        super().__init__(
            f"the capture store is full: this capture may take up to {estimate_bytes} bytes "
            f"and {room_bytes} are left under CAPTURE_DIR_MAX_BYTES; delete stored captures "
            "(DELETE /api/captures/{id}), wait for expired ones to be pruned, or capture less",
            details={
                "param": "capture",
                "estimate_bytes": estimate_bytes,
                "room_bytes": room_bytes,
                "setting": "CAPTURE_DIR_MAX_BYTES",
            },
        )


class UnknownAnalyzer(EngineError):
    """An analyzer name no registry entry has (details: ``known``)."""

    code = "unknown_analyzer"


class AnalyzerCaptureMissing(EngineError):
    """The capture an analyzer needs was not taken (or cannot be): layers, heads or
    positions missing from the request's capture or the stored artifact."""

    code = "analyzer_capture_missing"


class InvalidProbeFile(EngineError):
    """A probe file an analyzer was pointed at is missing, unreadable or malformed."""

    code = "invalid_probe_file"


class ModelNotLoaded(EngineError):
    code = "model_not_loaded"


class ModelLoadFailed(EngineError):
    code = "model_load_failed"


class BackendUnavailable(EngineError):
    """The model's backend cannot run here (its packages are not installed)."""

    code = "backend_unavailable"


class UnsupportedArchitecture(EngineError):
    code = "unsupported_architecture"

    def __init__(self, architecture_class: str) -> None:
        super().__init__(
            f"Unsupported architecture {architecture_class!r}: no decoder-block resolver is registered for it.",
            details={"architecture_class": architecture_class},
        )


class SAEFormatError(EngineError):
    """The SAE files are missing, corrupt or in a layout we cannot read."""

    code = "sae_format_error"


class SAEIncompatible(EngineError):
    """The SAE cannot be attached to this model/layer (d_in, layer range)."""

    code = "sae_incompatible"


class SAENotAttached(EngineError):
    code = "sae_not_attached"


class InvalidFeatureIndex(EngineError):
    code = "invalid_feature_index"

    def __init__(self, *, sae_id: str, index: int, d_sae: int, param: str | None = None) -> None:
        details = {"sae_id": sae_id, "feature_idx": index, "d_sae": d_sae}
        if param is not None:
            details["param"] = param  # the request field that named it
        super().__init__(f"Feature index {index} is out of range for SAE {sae_id!r} (d_sae={d_sae}).", details=details)


class UnsupportedQuantization(EngineError):
    """A load whose quantization cannot run here: a registry quantization without a kernel
    (Q2), or a pre-quantized checkpoint whose method this host cannot load."""

    code = "unsupported_quantization"


class InsufficientMemory(EngineError):
    code = "insufficient_memory"


class EngineBusy(EngineError):
    """A bounded wait (drain before attach/detach/unload) ran out."""

    code = "engine_busy"


class EngineShutdown(EngineError):
    code = "engine_shutdown"


class GenerationFailed(EngineError):
    code = "generation_failed"


class ResponseFormatUnsupported(EngineError):
    """A ``response_format`` the grammar compiler cannot turn into a grammar (a schema
    outside its subset); details: ``param`` (``response_format``) and ``reason``."""

    code = "response_format_unsupported"

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message, details={"param": "response_format", "reason": reason})


class SchemaTooComplex(EngineError):
    """A ``response_format`` (or tool) schema whose grammar was not built within
    ``STRUCTURED_COMPILE_TIMEOUT_S`` (``gpu_engine.decode.grammar.GrammarBuilder``); details:
    ``param`` and ``timeout_s``."""

    code = "schema_too_complex"

    def __init__(self, message: str, *, timeout_s: float = 0.0, param: str = "response_format") -> None:
        super().__init__(message, details={"param": param, "timeout_s": timeout_s})


__all__ = [
    "AnalyzerCaptureMissing",
    "InvalidProbeFile",
    "UnknownAnalyzer",
    "BackendUnavailable",
    "CaptureStoreFull",
    "CaptureTooLarge",
    "ContextLengthExceeded",
    "EngineBusy",
    "EngineError",
    "EngineShutdown",
    "GenerationFailed",
    "InsufficientMemory",
    "UnsupportedQuantization",
    "InvalidFeatureIndex",
    "InvalidParameter",
    "ModelLoadFailed",
    "ModelNotLoaded",
    "ResponseFormatUnsupported",
    "SAEFormatError",
    "SchemaTooComplex",
    "SAEIncompatible",
    "SAENotAttached",
    "UnsupportedArchitecture",
    "error_from_dict",
]
