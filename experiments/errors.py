"""Errors of the steering experiments (docs/experiments.md): each a code and a status on
``core.errors.MillmError``, answered in the /api envelope; ``details.param`` names the
field the refusal is about. A refusal of a variant (an unknown SAE or feature, a mode
the loaded backend cannot run) is the steering resolver's own error with its field named
where the experiment's body holds it (``variants[1].index``)."""

from __future__ import annotations

from core.errors import MillmError


class ExperimentNotFound(MillmError):
    code, status = "EXPERIMENT_NOT_FOUND", 404


class ExperimentNotCancellable(MillmError):
    """The run has ended (completed, failed or cancelled)."""

    code, status = "EXPERIMENT_NOT_CANCELLABLE", 409


class ExperimentUnavailable(MillmError):
    """The loaded backend cannot measure what the experiment needs (a calibration
    without teacher-forced distributions); ``details.reason`` is the backend's."""

    code, status = "EXPERIMENT_UNAVAILABLE", 422
