"""Steering domain errors (codes of the documented contract), raised by the resolver and
answered by each surface in its own shape: /api's envelope, /v1's OpenAI error."""

from __future__ import annotations

from millm_site.errors import MillmError


class ProfileNotFound(MillmError):
    code, status = "PROFILE_NOT_FOUND", 404


class ProfileIncompatible(MillmError):
    """The profile cannot apply to what is loaded and attached now."""

    code, status = "PROFILE_INCOMPATIBLE", 400


class SteeringInvalid(MillmError):
    """A steering request that is well-formed but names no usable attachment or value;
    ``details['param']`` names the field."""

    code, status = "VALIDATION_ERROR", 422
