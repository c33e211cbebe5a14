"""``GET /api/audit``: the audit log, for admin keys only (docs/api.md, "Audit log")."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from audit import services
from core.api import envelope, validated
from core.auth import require_admin
from core.schema import enveloped

MAX_LIMIT = 500


class AuditQuery(serializers.Serializer):
    action = serializers.CharField(required=False, max_length=64)
    actor = serializers.CharField(required=False, max_length=150)
    target = serializers.CharField(required=False, max_length=240)
    result = serializers.CharField(required=False, max_length=64)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)
    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=MAX_LIMIT)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=10_000_000)

    def validate(self, attrs):
        since, until = attrs.get("since"), attrs.get("until")
        if since is not None and until is not None and since > until:
            raise serializers.ValidationError({"until": ["until must not be before since"]})
        return attrs


class AuditListApi(APIView):
    @extend_schema(
        tags=["audit"],
        summary="The audit log, newest first (admin keys only)",
        operation_id="audit_list",
        parameters=[AuditQuery],
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def get(self, request) -> Response:
        require_admin(request, "reading the audit log")
        query = validated(AuditQuery, request.query_params)
        rows = services.audit_query(
            action=query.get("action"),
            actor=query.get("actor"),
            target=query.get("target"),
            result=query.get("result"),
            since=query.get("since"),
            until=query.get("until"),
        )
        total = rows.count()
        start = query["offset"]
        page = rows[start : start + query["limit"]]
        return envelope(
            {
                "entries": [services.entry_out(r) for r in page],
                "total": total,
                "limit": query["limit"],
                "offset": start,
            }
        )
