"""The /api routes of feature dashboards and search (features/urls.py, docs/api.md "Feature
dashboards"): thin views, one per action. Each validates its input with a serializer (a
refusal is 422 VALIDATION_ERROR naming the field), calls one service or selector, and
answers the envelope. Who may see which run is the services' and selectors' rule: a run is
its owner's, another inference key's run or corpus file is a 404, an admin key sees all."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope, validated
from core.auth import principal
from core.errors import InvalidFeatureIndex
from core.run_apis import (
    layer_field,
    listing,
    listing_output,
    output_of,
    page_fields,
    run_envelope_output,
    run_route,
)
from core.schema import MAX_INDEX, enveloped
from features import selectors, services
from features.corpus_options import CorpusChecks, corpus_fields
from features.models import DashboardRun, FeatureDashboard
from registry import labels
from registry import selectors as registry_selectors
from steering.rules import check_indices

DASHBOARDS, FEATURES = ["dashboards"], ["features"]

# --------------------------------------------------------------------------- inputs


class DashboardStartInput(CorpusChecks, serializers.Serializer):
    corpus = serializers.ChoiceField(choices=DashboardRun.Corpus.values)
    file_id, text_field, token_budget, context_tokens = corpus_fields()
    top_k = serializers.IntegerField(required=False, default=10, min_value=1, max_value=100)
    window = serializers.IntegerField(required=False, default=8, min_value=0, max_value=64)
    layer = layer_field()


class RunListQuery(serializers.Serializer):
    limit, offset = page_fields(50, 200)


class SearchQuery(serializers.Serializer):
    q = serializers.CharField(required=False, allow_blank=True, default="", max_length=200, trim_whitespace=True)
    token = serializers.CharField(required=False, allow_blank=True, default="", max_length=100, trim_whitespace=False)
    limit, offset = page_fields(50, 200)


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
    return output_of(
        RunOutput,
        run,
        corpus_file_id=run.corpus_file_id if file_run else None,
        text_field=run.text_field if file_run else None,
        summary=run.summary or {},
    )


RunEnvelopeOutput = run_envelope_output(RunOutput)
RunListOutput = listing_output("RunListOutput", "runs", RunOutput)


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


SearchOutput = listing_output("SearchOutput", "features", SearchHitOutput)


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
        return envelope(listing(selectors.runs_for(sae_id, principal(request)), query, "runs", run_out))

    @extend_schema(
        tags=DASHBOARDS,
        summary="Start a dashboard run over a corpus (the offline sample or the caller's /v1 file)",
        operation_id="dashboards_start",
        request=DashboardStartInput,
        responses={202: enveloped(RunEnvelopeOutput)},
    )
    def post(self, request, sae_id: str) -> Response:
        data = validated(DashboardStartInput, request.data)
        run = dashboard_start(sae_id, principal(request), data)
        return envelope({"run": run_out(run)}, status_code=status.HTTP_202_ACCEPTED)


def dashboard_start(sae_id: str, who: Any, data: dict[str, Any]) -> DashboardRun:
    """Queue a run of ``DashboardStartInput``'s checked ``data``: the route's and
    ``manage.py dashboards``' one way in."""
    return services.dashboard_start(
        sae_id=sae_id,
        principal=who,
        corpus=data["corpus"],
        file_id=data.get("file_id"),
        text_field=data["text_field"],
        token_budget=data["token_budget"],
        context_tokens=data["context_tokens"],
        top_k=data["top_k"],
        window=data["window"],
        layer=data["layer"],
    )


DashboardDetailApi = run_route(
    "DashboardDetailApi",
    "get",
    selectors.dashboard_get,
    run_out,
    tags=DASHBOARDS,
    summary="A dashboard run: status, progress, summary",
    operation_id="dashboards_get",
    responses=enveloped(RunOutput),
)
DashboardCancelApi = run_route(
    "DashboardCancelApi",
    "post",
    services.dashboard_cancel,
    run_out,
    tags=DASHBOARDS,
    summary="Cancel a queued or running run (its dashboards are not stored)",
    operation_id="dashboards_cancel",
    request=None,
    responses=enveloped(RunOutput),
)


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
