"""``GET /api/usage`` (docs/api.md, "Usage"): usage per key and day, as JSON in the
envelope or as CSV (``?format=csv``). An admin key (or anyone with keys off) reads every
key's rows; an inference key only its own, and naming another key is 403."""

from __future__ import annotations

import datetime as dt

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import AnyAcceptNegotiation, envelope, validated
from core.auth import principal
from core.errors import Forbidden, ValidationFailed
from inference import usage

# the longest range one call reads (a year and a day): bounded work whatever is asked
MAX_DAYS = 366
DEFAULT_DAYS = 31


class UsageQuery(serializers.Serializer):
    key = serializers.RegexField(r"^[A-Za-z0-9_.@-]{1,64}$", required=False)
    start = serializers.DateField(required=False, input_formats=["%Y-%m-%d"])
    end = serializers.DateField(required=False, input_formats=["%Y-%m-%d"])
    format = serializers.ChoiceField(choices=["json", "csv"], required=False, default="json")


class UsageApi(APIView):
    content_negotiation_class = AnyAcceptNegotiation

    @extend_schema(
        tags=["usage"],
        summary="Usage per key and day (requests, prompt and completion tokens, steered share)",
        parameters=[
            OpenApiParameter("key", str, required=False, description="a key label (an inference key: its own)"),
            OpenApiParameter(
                "start", OpenApiTypes.DATE, required=False, description="first day (UTC), default end - 30"
            ),
            OpenApiParameter("end", OpenApiTypes.DATE, required=False, description="last day (UTC), default today"),
            OpenApiParameter("format", str, required=False, enum=["json", "csv"]),
        ],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request) -> Response | HttpResponse:
        query = validated(UsageQuery, request.query_params)
        end = query.get("end") or dt.datetime.now(dt.UTC).date()
        start = query.get("start")
        if start is None:
            try:
                start = end - dt.timedelta(days=DEFAULT_DAYS - 1)
            except OverflowError:  # an end in the first month of year 1
                start = dt.date.min
        if start > end:
            raise ValidationFailed("start is after end", details={"fields": {"start": ["after end"]}})
        if (end - start).days + 1 > MAX_DAYS:
            raise ValidationFailed(
                f"the range is {(end - start).days + 1} days; at most {MAX_DAYS} in one call",
                details={"fields": {"start": [f"at most {MAX_DAYS} days before end"]}, "max_days": MAX_DAYS},
            )
        who = principal(request)
        key = query.get("key")
        if who.admin:
            owners = None if key is None else [f"key:{key}" if key != "anonymous" else "anonymous"]
        else:
            if key is not None and key != who.label:
                raise Forbidden(
                    "reading another key's usage needs an admin key (MILLM_ADMIN_API_KEYS); "
                    "an inference key reads only its own",
                    details={"param": "key"},
                )
            owners = [who.owner]
        items = usage.rows(owners=owners, start=start, end=end)
        if query["format"] == "csv":
            response = HttpResponse(usage.as_csv(items), content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = f'attachment; filename="usage-{start}-{end}.csv"'
            return response
        return envelope(
            {
                "usage": items,
                "total": len(items),
                "totals": usage.totals(items),
                "start": start.isoformat(),
                "end": end.isoformat(),
            }
        )
