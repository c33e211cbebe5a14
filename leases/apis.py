"""/api/models/{id}/lease: grant (201, the id returned once), read (never the id), renew,
release. Thin views over ``leases.services``."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope
from core.schema import enveloped
from leases import selectors, services
from leases.errors import LEASE_HEADER, InvalidLeaseRequest
from registry.selectors import model_get

LEASES = ["leases"]
_HEADER = OpenApiParameter(
    LEASE_HEADER, str, OpenApiParameter.HEADER, required=True, description="The lease id returned by the grant"
)


def _body(request) -> dict:
    data = request.data if request.data is not None else {}
    if not isinstance(data, dict):
        raise InvalidLeaseRequest("The body must be a JSON object", details={"param": "body"})
    return data


class LeaseGrantInput(serializers.Serializer):
    holder = serializers.CharField(help_text="Who holds it (free text, 1-128 chars)")
    reason = serializers.CharField(help_text="Why (free text, 1-512 chars)")
    ttl_seconds = serializers.IntegerField(
        required=False, help_text=("1..LEASE_MAX_TTL_SECONDS (default LEASE_DEFAULT_TTL_SECONDS); above is 400")
    )


_LEASE = inline_serializer(
    "Lease",
    {
        "lease_id": serializers.CharField(help_text="Only in the grant's answer"),
        "model_id": serializers.IntegerField(),
        "model_name": serializers.CharField(),
        "holder": serializers.CharField(),
        "reason": serializers.CharField(),
        "acquired_at": serializers.DateTimeField(),
        "renewed_at": serializers.DateTimeField(),
        "expires_at": serializers.DateTimeField(),
        "ttl_seconds": serializers.IntegerField(),
        "seconds_remaining": serializers.IntegerField(),
    },
)


class ModelLeaseApi(APIView):
    @extend_schema(
        tags=LEASES,
        summary="Lease the resident model (201; the lease id is returned here and never again)",
        request=LeaseGrantInput,
        responses={201: enveloped(_LEASE)},
    )
    def post(self, request, model_id: int) -> Response:
        model = model_get(model_id=model_id)
        data = _body(request)
        # validated by the service, so a bad field is INVALID_LEASE_REQUEST naming it
        lease, lease_id = services.lease_grant(
            model=model, holder=data.get("holder"), reason=data.get("reason"), ttl_seconds=data.get("ttl_seconds")
        )
        return envelope({"lease_id": lease_id, **selectors.lease_out(lease)}, status_code=status.HTTP_201_CREATED)

    @extend_schema(
        tags=LEASES,
        summary="The live lease and the last ended one (never the id)",
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def get(self, request, model_id: int) -> Response:
        return envelope(selectors.lease_status(model=model_get(model_id=model_id)))

    @extend_schema(
        tags=LEASES,
        summary="Release (header X-miLLM-Lease)",
        parameters=[_HEADER],
        request=None,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def delete(self, request, model_id: int) -> Response:
        lease = services.lease_release(model=model_get(model_id=model_id), lease_id=request.headers.get(LEASE_HEADER))
        return envelope(selectors.lease_out(lease))


class ModelLeaseRenewApi(APIView):
    @extend_schema(
        tags=LEASES,
        summary="Renew: expires_at = now + ttl_seconds (header X-miLLM-Lease)",
        parameters=[_HEADER],
        request=inline_serializer("LeaseRenew", {"ttl_seconds": serializers.IntegerField(required=False)}),
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request, model_id: int) -> Response:
        data = _body(request)
        lease = services.lease_renew(
            model=model_get(model_id=model_id),
            lease_id=request.headers.get(LEASE_HEADER),
            ttl_seconds=data.get("ttl_seconds"),
        )
        return envelope(selectors.lease_out(lease))
