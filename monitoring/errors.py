"""Monitoring's domain errors."""

from __future__ import annotations

from core.errors import MillmError


class CaptureNotFound(MillmError):
    """No stored capture has this id (also any id that is not 32 hex digits)."""

    code, status = "CAPTURE_NOT_FOUND", 404


# probes (docs/monitoring.md, Probes): the original's codes


class ProbeNotFound(MillmError):
    """No probe has this id or name."""

    code, status = "PROBE_NOT_FOUND", 404


class ProbeInvalid(MillmError):
    """A probe definition or file this server cannot read: missing or non-numeric weights,
    lengths that disagree, a pickle, a malformed JSON or ``.npz``."""

    code, status = "PROBE_INVALID", 400


class ProbeExists(MillmError):
    """Another probe has this name (there is no in-place replace: delete, then import)."""

    code, status = "PROBE_EXISTS", 409


class ProbeModelMismatch(MillmError):
    """The probe does not fit the resident model or SAE; ``details.mismatches`` names every
    differing field ``{field, expected, actual}``."""

    code, status = "PROBE_MODEL_MISMATCH", 409


class UnvalidatedProbe(MillmError):
    """The probe has not been validated against the resident model (and SAE)."""

    code, status = "UNVALIDATED_PROBE", 409


class ProbeLimit(MillmError):
    code, status = "PROBE_LIMIT", 409


class ProbeScoreRequestInvalid(MillmError):
    """A ``probes`` field (or scoring request) refused as a whole before any forward."""

    code, status = "INVALID_PROBE_SCORE_REQUEST", 400


class AnalysisUnavailable(MillmError):
    """Distributed mode: no worker on the Celery ``analysis`` queue answered within
    ``ANALYSIS_TIMEOUT_S``, so the analysis ran nowhere (the web process never runs it)."""

    code, status = "ANALYSIS_UNAVAILABLE", 503
