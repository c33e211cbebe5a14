"""Steering domain errors (codes of the documented contract), raised by the resolver and
answered by each surface in its own shape: /api's envelope, /v1's OpenAI error."""

from __future__ import annotations

from core.errors import MillmError


class ProfileNotFound(MillmError):
    code, status = "PROFILE_NOT_FOUND", 404


class ProfileIncompatible(MillmError):
    """The profile cannot apply to what is loaded and attached now."""

    code, status = "PROFILE_INCOMPATIBLE", 400


class SteeringInvalid(MillmError):
    """A steering request that is well-formed but names no usable attachment or value;
    ``details['param']`` names the field."""

    code, status = "VALIDATION_ERROR", 422


class ProfileAlreadyExists(MillmError):
    code, status = "PROFILE_ALREADY_EXISTS", 409


class AmbiguousSAE(MillmError):
    """Several attachments and the request named none (or not enough): ``details.choices``
    lists them as ``sae_id@layer``."""

    code, status = "AMBIGUOUS_SAE", 400


class ClusterNotFound(MillmError):
    code, status = "CLUSTER_NOT_FOUND", 404


class DocumentNotFound(MillmError):
    code, status = "CIRCUIT_NOT_FOUND", 404


class IncompatibleFeatureSpace(MillmError):
    """A document's declared feature space does not match the SAE it would steer through."""

    code, status = "INCOMPATIBLE_FEATURE_SPACE", 422


class SAESetIncomplete(MillmError):
    """A circuit member's SAE cannot be attached; ``details.offenders`` names each."""

    code, status = "SAE_SET_INCOMPLETE", 422


# The refusals below are decisions about a well-formed request, answered — as the
# original documents them — with HTTP 200 and ``success: false``: clients branch on
# ``error.code`` and re-send with the acknowledgement or override the details describe.


class UnvalidatedCircuit(MillmError):
    code, status = "UNVALIDATED_CIRCUIT", 200


class CircuitLayerContention(MillmError):
    code, status = "CIRCUIT_LAYER_CONTENTION", 200


class NoActiveCircuit(MillmError):
    code, status = "NO_ACTIVE_CIRCUIT", 200


class AmbiguousActiveCircuit(MillmError):
    code, status = "AMBIGUOUS_ACTIVE_CIRCUIT", 200


class NoActiveCluster(MillmError):
    code, status = "NO_ACTIVE_CLUSTER", 200


class IsClusterDocument(MillmError):
    code, status = "IS_CLUSTER_DOCUMENT", 200


class UnknownKind(MillmError):
    code, status = "UNKNOWN_KIND", 200


class PayloadTooLarge(MillmError):
    code, status = "PAYLOAD_TOO_LARGE", 200
