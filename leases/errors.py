"""Lease refusals, with the codes of the documented contract."""

from __future__ import annotations

from core.errors import MillmError

LEASE_HEADER = "X-miLLM-Lease"


class ModelLeased(MillmError):
    """Another holder leases the resident model; ``details`` names who, why and until when."""

    code, status = "MODEL_LEASED", 409


class ModelNotResident(MillmError):
    code, status = "MODEL_NOT_RESIDENT", 409


class LeaseNotFound(MillmError):
    code, status = "LEASE_NOT_FOUND", 404


class LeaseExpired(MillmError):
    """The lease existed and has ended; ``details.end_reason`` says how."""

    code, status = "LEASE_EXPIRED", 409


class InvalidLeaseRequest(MillmError):
    """``details.param`` names the field (or header) and the limit."""

    code, status = "INVALID_LEASE_REQUEST", 400
