"""The /api routes of feature dashboards and search (features/urls.py, docs/api.md "Feature
dashboards"): thin views, one per action. Each validates its input with a serializer (a
refusal is 422 VALIDATION_ERROR naming the field), calls one service or selector, and
answers the envelope. Who may see which run is the services' and selectors' rule: a run is
its owner's, another inference key's run or corpus file is a 404, an admin key sees all."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope, validated
from core.auth import principal
from core.errors import InvalidFeatureIndex
from core.schema import MAX_INDEX, MAX_LAYER, enveloped
from features import selectors, services
from features.models import DashboardRun, FeatureDashboard
from registry import labels
from registry import selectors as registry_selectors
from steering.rules import check_indices

DASHBOARDS, FEATURES = ["dashboards"], ["features"]
TEXT_FIELD = r"^[A-Za-z0-9_-]{1,100}$"

# --------------------------------------------------------------------------- inputs


class DashboardStartInput(serializers.Serializer):
    corpus = serializers.ChoiceField(choices=DashboardRun.Corpus.values)
    file_id = serializers.CharField(
        required=False, max_length=40, help_text="a /v1/files id of the caller's; required iff corpus is file"
    )
    text_field = serializers.RegexField(
        TEXT_FIELD,
        required=False,
        default="text",
        max_length=100,
        error_messages={"invalid": "a JSON field name: letters, digits, _ and -, at most 100"},
        help_text="the field of the file's JSONL rows that holds the text (read only for a file)",
    )
    token_budget = serializers.IntegerField(min_value=1, help_text="corpus tokens to read, ≤ DASHBOARD_MAX_TOKENS")
    context_tokens = serializers.IntegerField(required=False, default=64, min_value=8, max_value=1024)
    top_k = serializers.IntegerField(required=False, default=10, min_value=1, max_value=100)
    window = serializers.IntegerField(required=False, default=8, min_value=0, max_value=64)
    layer = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=0, max_value=MAX_LAYER, help_text="null: attached"
    )

    def validate_token_budget(self, value: int) -> int:
        cap = settings.DASHBOARD_MAX_TOKENS
        if value > cap:
            raise serializers.ValidationError(f"at most {cap} (DASHBOARD_MAX_TOKENS)")
        return value

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["corpus"] == DashboardRun.Corpus.FILE and not data.get("file_id"):
            raise serializers.ValidationError({"file_id": ["required when corpus is file"]})
        if data["corpus"] != DashboardRun.Corpus.FILE and "file_id" in data:
            raise serializers.ValidationError({"file_id": ["only with corpus file"]})
        return data


class RunListQuery(serializers.Serializer):
    limit = serializers.IntegerField(required=False, default=50, min_value=1, max_value=200)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=MAX_INDEX)


class SearchQuery(serializers.Serializer):
    q = serializers.CharField(required=False, allow_blank=True, default="", max_length=200, trim_whitespace=True)
    token = serializers.CharField(required=False, allow_blank=True, default="", max_length=100, trim_whitespace=False)
    limit = serializers.IntegerField(required=False, default=50, min_value=1, max_value=200)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=MAX_INDEX)


# --------------------------------------------------------------------------- outputs


class RunOutput(serializers.Serializer):
    id = serializers.CharField()
    sae_id = serializers.CharField()
    layer = serializers.IntegerField()
    status = serializers.ChoiceField(choices=DashboardRun.Status.values)
    complete = serializers.BooleanField(help_text="every feature's dashboard of this run is stored")
    corpus = serializers.ChoiceField(choices=DashboardRun.Corpus.values)
    corpus_file_id = serializers.CharField(allow_null=True)
    text_field = serializers.CharField(allow_null=True)
    token_budget = serializers.IntegerField()
    context_tokens = serializers.IntegerField()
    top_k = serializers.IntegerField()
    window = serializers.IntegerField()
    contexts_done = serializers.IntegerField()
    contexts_total = serializers.IntegerField()
    tokens_done = serializers.IntegerField()
    error = serializers.JSONField(allow_null=True, help_text="{code, message} of a failed run")
    summary = serializers.JSONField(help_text="corpus-wide: tokens, contexts, dead, dead_share, dense, l0")
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


def run_out(run: DashboardRun) -> dict[str, Any]:
    file_run = run.corpus == DashboardRun.Corpus.FILE
    return RunOutput(
        {
            "id": run.id,
            "sae_id": run.sae_id,
            "layer": run.layer,
            "status": run.status,
            "complete": run.complete,
            "corpus": run.corpus,
            "corpus_file_id": run.corpus_file_id if file_run else None,
            "text_field": run.text_field if file_run else None,
            "token_budget": run.token_budget,
            "context_tokens": run.context_tokens,
            "top_k": run.top_k,
            "window": run.window,
            "contexts_done": run.contexts_done,
            "contexts_total": run.contexts_total,
            "tokens_done": run.tokens_done,
            "error": run.error,
            "summary": run.summary or {},
            "created_at": run.created_at,
            "started_at": run.started_at,
            "finished_at": run.finished_at,
        }
    ).data


class RunEnvelopeOutput(serializers.Serializer):
    run = RunOutput()


class RunListOutput(serializers.Serializer):
    runs = RunOutput(many=True)
    total = serializers.IntegerField()


class DashboardOutput(serializers.Serializer):
    count = serializers.IntegerField(help_text="tokens at which the feature is above 0")
    density = serializers.FloatField(help_text="count / the corpus's tokens")
    mean = serializers.FloatField(help_text="mean over the tokens above 0")
    max = serializers.FloatField()
    histogram = serializers.JSONField(help_text="{edges, counts} over the non-zero activations")
    top_contexts = serializers.JSONField()
    quantile_samples = serializers.JSONField()
    logit_top = serializers.JSONField(help_text="[{token_id, token, value}] of W_dec[i] @ W_U.T, highest first")
    logit_bottom = serializers.JSONField(help_text="the lowest, lowest first")


def dashboard_out(row: FeatureDashboard) -> dict[str, Any]:
    return DashboardOutput(row).data


class FeatureOutput(serializers.Serializer):
    sae_id = serializers.CharField()
    index = serializers.IntegerField()
    label = serializers.CharField(allow_null=True)
    explanations = serializers.JSONField()
    dashboard = DashboardOutput(allow_null=True, help_text="null: no complete run covers it yet")
    run_id = serializers.CharField(allow_null=True)


class SearchHitOutput(serializers.Serializer):
    index = serializers.IntegerField()
    label = serializers.CharField(allow_null=True)
    density = serializers.FloatField(allow_null=True)
    max = serializers.FloatField(allow_null=True)
    score = serializers.FloatField()
    matched = serializers.ListField(child=serializers.CharField())


class SearchOutput(serializers.Serializer):
    features = SearchHitOutput(many=True)
    total = serializers.IntegerField()


# --------------------------------------------------------------------------- views


class DashboardListCreateApi(APIView):
    @extend_schema(
        tags=DASHBOARDS,
        summary="The SAE's dashboard runs, newest first (an inference key: its own)",
        operation_id="dashboards_list",
        parameters=[OpenApiParameter("limit", int, required=False), OpenApiParameter("offset", int, required=False)],
        responses=enveloped(RunListOutput),
    )
    def get(self, request, sae_id: str) -> Response:
        query = validated(RunListQuery, request.query_params)
        registry_selectors.sae_get(sae_id=sae_id)
        runs = selectors.runs_for(sae_id, principal(request))
        total = runs.count()
        page = runs[query["offset"] : query["offset"] + query["limit"]]
        return envelope({"runs": [run_out(r) for r in page], "total": total})

    @extend_schema(
        tags=DASHBOARDS,
        summary="Start a dashboard run over a corpus (the offline sample or the caller's /v1 file)",
        operation_id="dashboards_start",
        request=DashboardStartInput,
        responses={202: enveloped(RunEnvelopeOutput)},
    )
    def post(self, request, sae_id: str) -> Response:
        data = validated(DashboardStartInput, request.data)
        run = services.dashboard_start(
            sae_id=sae_id,
            principal=principal(request),
            corpus=data["corpus"],
            file_id=data.get("file_id"),
            text_field=data["text_field"],
            token_budget=data["token_budget"],
            context_tokens=data["context_tokens"],
            top_k=data["top_k"],
            window=data["window"],
            layer=data["layer"],
        )
        return envelope({"run": run_out(run)}, status_code=status.HTTP_202_ACCEPTED)


class DashboardDetailApi(APIView):
    @extend_schema(
        tags=DASHBOARDS,
        summary="A dashboard run: status, progress, summary",
        operation_id="dashboards_get",
        responses=enveloped(RunOutput),
    )
    def get(self, request, run_id: str) -> Response:
        return envelope(run_out(selectors.dashboard_get(run_id, principal(request))))


class DashboardCancelApi(APIView):
    @extend_schema(
        tags=DASHBOARDS,
        summary="Cancel a queued or running run (its dashboards are not stored)",
        operation_id="dashboards_cancel",
        request=None,
        responses=enveloped(RunOutput),
    )
    def post(self, request, run_id: str) -> Response:
        return envelope(run_out(services.dashboard_cancel(run_id=run_id, principal=principal(request))))


def feature_index(sae: Any, index: str) -> int:
    """The route's index inside the SAE's feature space, else INVALID_FEATURE_INDEX."""
    value = int(index)
    check_indices(sae_id=sae.id, d_sae=sae.d_sae, indices=[value], param="index")
    if value > MAX_INDEX:  # d_sae unknown: the database's integer column still bounds it
        raise InvalidFeatureIndex(
            f"Feature index {value} is out of range (at most {MAX_INDEX})",
            details={"param": "index", "feature_idx": value, "sae_id": sae.id, "d_sae": sae.d_sae},
        )
    return value


class FeatureDetailApi(APIView):
    @extend_schema(
        tags=FEATURES,
        summary="A feature: its label, explanations and dashboard (null before any complete run)",
        operation_id="features_get",
        responses=enveloped(FeatureOutput),
    )
    def get(self, request, sae_id: str, index: str) -> Response:
        sae = registry_selectors.sae_get(sae_id=sae_id)
        value = feature_index(sae, index)
        row = selectors.feature_dashboard(sae.id, value, principal(request))
        return envelope(
            {
                "sae_id": sae.id,
                "index": value,
                "label": labels.labels_for(sae.id, [value]).get(value),
                "explanations": labels.explanations_for(sae.id, value),
                "dashboard": None if row is None else dashboard_out(row),
                "run_id": None if row is None else row.run_id,
            }
        )


class FeatureSearchApi(APIView):
    @extend_schema(
        tags=FEATURES,
        summary="Search the SAE's features by label and explanation text (q) or by a token (token)",
        operation_id="features_search",
        parameters=[
            OpenApiParameter("q", str, required=False, description="words of a label or explanation (≤ 200 chars)"),
            OpenApiParameter("token", str, required=False, description="a token of top contexts or logit effects"),
            OpenApiParameter("limit", int, required=False),
            OpenApiParameter("offset", int, required=False),
        ],
        responses=enveloped(SearchOutput),
    )
    def get(self, request, sae_id: str) -> Response:
        query = validated(SearchQuery, request.query_params)
        registry_selectors.sae_get(sae_id=sae_id)
        return envelope(
            selectors.search_features(
                sae_id, query["q"], query["token"], query["limit"], query["offset"], principal(request)
            )
        )
