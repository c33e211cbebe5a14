"""/api/monitoring: state, configure, enable, history, statistics. Thin views."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import AnyAcceptNegotiation, envelope, validated
from core.runtime import runtime
from core.schema import MAX_INDEX, MAX_LAYER, enveloped
from monitoring import selectors, services
from monitoring.analysis import capture_analyze
from monitoring.models import MonitoringConfig
from monitoring.ownership import Scope

MONITORING = ["monitoring"]
_ANY = enveloped(OpenApiTypes.OBJECT)


class ConfigureInput(serializers.Serializer):
    enabled = serializers.BooleanField(required=False, default=True)
    features = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=MAX_INDEX),
        required=False,
        allow_null=True,
        max_length=services.MAX_FEATURES,
        help_text="null: all features (recorded as the top-k); left out: as configured",
    )
    history_size = serializers.IntegerField(required=False, min_value=1, max_value=services.MAX_HISTORY)
    top_k = serializers.IntegerField(required=False, min_value=1, max_value=services.MAX_TOP_K)
    positions = serializers.ChoiceField(choices=MonitoringConfig.Positions.values, required=False)
    sae_id = serializers.CharField(required=False, allow_null=True, max_length=40)
    layer = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_LAYER)


class EnableInput(serializers.Serializer):
    enabled = serializers.BooleanField()


class HistoryQuery(serializers.Serializer):
    limit = serializers.IntegerField(required=False, default=50, min_value=1, max_value=1000)
    request_id = serializers.CharField(required=False, max_length=100)


class StatisticsQuery(serializers.Serializer):
    features = serializers.RegexField(r"^\d+(,\d+)*$", required=False, help_text="Comma-separated feature indices")


class TopInput(serializers.Serializer):
    k = serializers.IntegerField(required=False, default=10, min_value=1, max_value=1000)
    metric = serializers.ChoiceField(choices=selectors.METRICS, required=False, default="mean")


class MonitoringApi(APIView):
    @extend_schema(tags=MONITORING, summary="Monitoring state", responses=_ANY)
    def get(self, request) -> Response:
        return envelope(services.monitoring_state(Scope.of_request(request)))


class MonitoringConfigureApi(APIView):
    @extend_schema(
        tags=MONITORING,
        summary="Configure what /v1 generations record (features or all, history_size, top_k)",
        request=ConfigureInput,
        responses=_ANY,
    )
    def post(self, request) -> Response:
        data = validated(ConfigureInput, request.data or {})
        # what the request leaves out keeps its configured value
        kept = {k: data[k] for k in ("features", "history_size", "top_k", "positions") if k in data}
        return envelope(
            services.monitoring_configure(
                enabled=data["enabled"], sae_id=data.get("sae_id"), layer=data.get("layer"), **kept
            )
        )


class MonitoringEnableApi(APIView):
    @extend_schema(tags=MONITORING, summary="Toggle without reconfiguring", request=EnableInput, responses=_ANY)
    def post(self, request) -> Response:
        data = validated(EnableInput, request.data or {})
        return envelope(services.monitoring_enable(enabled=data["enabled"]))


class HistoryApi(APIView):
    @extend_schema(
        tags=MONITORING,
        summary="Recorded activations, newest first",
        parameters=[
            OpenApiParameter("limit", int, required=False),
            OpenApiParameter("request_id", str, required=False),
        ],
        responses=_ANY,
    )
    def get(self, request) -> Response:
        query = validated(HistoryQuery, request.query_params)
        return envelope(
            selectors.history(limit=query["limit"], request_id=query.get("request_id"), scope=Scope.of_request(request))
        )

    @extend_schema(
        tags=MONITORING, summary="Clear the history (the caller's own; an admin key's: everyone's)", responses=_ANY
    )
    def delete(self, request) -> Response:
        return envelope({"deleted": services.monitoring_history_clear(scope=Scope.of_request(request))})


class StatisticsApi(APIView):
    @extend_schema(
        tags=MONITORING,
        summary="Per-feature statistics over the history",
        parameters=[OpenApiParameter("features", str, required=False)],
        responses=_ANY,
    )
    def get(self, request) -> Response:
        query = validated(StatisticsQuery, request.query_params)
        features = [int(f) for f in query["features"].split(",")] if query.get("features") else None
        return envelope(selectors.statistics(features=features, scope=Scope.of_request(request)))

    @extend_schema(tags=MONITORING, summary="Reset: statistics count from now", responses=_ANY)
    def delete(self, request) -> Response:
        return envelope(services.monitoring_statistics_reset())


class StatisticsTopApi(APIView):
    @extend_schema(
        tags=MONITORING, summary="Top features by mean, max, active_ratio or count", request=TopInput, responses=_ANY
    )
    def post(self, request) -> Response:
        data = validated(TopInput, request.data or {})
        return envelope(selectors.statistics_top(k=data["k"], metric=data["metric"], scope=Scope.of_request(request)))


# --------------------------------------------------------------------------- captures

CAPTURES = ["captures"]


class CaptureListQuery(serializers.Serializer):
    limit = serializers.IntegerField(required=False, default=50, min_value=1, max_value=1000)
    request_id = serializers.CharField(required=False, max_length=100)


class CaptureListApi(APIView):
    @extend_schema(
        tags=CAPTURES,
        summary="Stored captures, newest first",
        parameters=[
            OpenApiParameter("limit", int, required=False),
            OpenApiParameter("request_id", str, required=False),
        ],
        responses=_ANY,
    )
    def get(self, request) -> Response:
        query = validated(CaptureListQuery, request.query_params)
        return envelope(
            selectors.capture_list(
                limit=query["limit"], request_id=query.get("request_id"), scope=Scope.of_request(request)
            )
        )


class CaptureDetailApi(APIView):
    @extend_schema(tags=CAPTURES, summary="A stored capture's metadata (row and sidecar)", responses=_ANY)
    def get(self, request, capture_id: str) -> Response:
        return envelope(selectors.capture_detail(capture_id=capture_id, scope=Scope.of_request(request)))

    @extend_schema(tags=CAPTURES, summary="Delete a stored capture and its files", responses=_ANY)
    def delete(self, request, capture_id: str) -> Response:
        services.capture_delete(capture_id=capture_id, scope=Scope.of_request(request))
        return envelope({"deleted": capture_id})


class AnalyzeInput(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    params = serializers.DictField(required=False, default=dict)


class CaptureAnalyzeApi(APIView):
    @extend_schema(tags=CAPTURES, summary="Run an analyzer on a stored capture", request=AnalyzeInput, responses=_ANY)
    def post(self, request, capture_id: str) -> Response:
        data = validated(AnalyzeInput, request.data or {})
        return envelope(
            capture_analyze(
                capture_id=capture_id,
                name=data["name"],
                params=data["params"],
                analyzers=runtime().analyzers,
                scope=Scope.of_request(request),
            )
        )


class CaptureDownloadApi(APIView):
    content_negotiation_class = AnyAcceptNegotiation

    @extend_schema(
        tags=CAPTURES,
        summary="The capture's safetensors file",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY},
    )
    def get(self, request, capture_id: str):  # type: ignore[no-untyped-def]
        from django.http import FileResponse

        path = selectors.capture_file(capture_id=capture_id, scope=Scope.of_request(request))
        return FileResponse(
            path.open("rb"), as_attachment=True, filename=path.name, content_type="application/octet-stream"
        )
