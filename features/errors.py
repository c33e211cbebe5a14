"""Errors of the feature dashboards (docs/features.md): each a code and a status on
``core.errors.MillmError``, answered in the /api envelope; ``details.param`` names the
field the refusal is about."""

from __future__ import annotations

from core.errors import MillmError


class DashboardSAENotAttached(MillmError):
    """A run on an SAE that is not attached (at the layer asked for): nothing to read the
    corpus with. ``details.layers`` lists the layers it is attached at (none: empty)."""

    code, status = "SAE_NOT_ATTACHED", 409


class DashboardNotFound(MillmError):
    code, status = "DASHBOARD_NOT_FOUND", 404


class DashboardNotCancellable(MillmError):
    """The run has ended (completed, failed or cancelled)."""

    code, status = "DASHBOARD_NOT_CANCELLABLE", 409


class InvalidCorpus(MillmError):
    """A corpus file that is empty, not UTF-8 text, or whose JSONL rows lack the text
    field (``details.reason``: the corpus reader's code)."""

    code, status = "INVALID_CORPUS", 400
