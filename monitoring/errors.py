"""Monitoring's domain errors."""

from __future__ import annotations

from core.errors import MillmError


class CaptureNotFound(MillmError):
    """No stored capture has this id (also any id that is not 32 hex digits)."""

    code, status = "CAPTURE_NOT_FOUND", 404
