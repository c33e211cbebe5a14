"""The /api routes of the steering experiments (experiments/urls.py, docs/api.md
"Experiments"): thin views, one per action. Each validates its input with a serializer (a
refusal is 422 VALIDATION_ERROR naming the field), calls one service or selector, and
answers the envelope (a download answers the file). A run is its owner's: another
inference key's run is a 404; an admin key sees all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import AnyAcceptNegotiation, envelope, validated
from core.auth import principal
from core.run_apis import listing, listing_output, output_of, page_fields, run_envelope_output, run_route
from core.schema import enveloped
from experiments import exports, selectors, services
from experiments.models import ExperimentPoint, ExperimentRun
from experiments.sweep import (
    MAX_PROMPTS,
    MAX_STRENGTHS,
    MAX_TOKENS,
    MAX_VARIANTS,
)

EXPERIMENTS = ["experiments"]

# --------------------------------------------------------------------------- inputs


class SweepInput(serializers.Serializer):
    prompts = serializers.ListField(
        child=serializers.JSONField(),
        min_length=1,
        max_length=MAX_PROMPTS,
        help_text="each a text (a completion) or {messages: [...]} (a chat)",
    )
    variants = serializers.ListField(
        child=serializers.DictField(),
        min_length=1,
        max_length=MAX_VARIANTS,
        help_text="each {sae_id?, layer?, index, mode?, phase?, window?, condition?, target?, label?} "
        "(an SAE feature or an attached vector) or {vector: {data, layer?, hook?, mode?, min?, max?}, "
        "target?, label?} (an inline vector)",
    )
    strengths = serializers.ListField(
        child=serializers.FloatField(), min_length=1, max_length=MAX_STRENGTHS, help_text="each variant at each"
    )
    max_tokens = serializers.IntegerField(required=False, default=32, min_value=1, max_value=MAX_TOKENS)
    temperature = serializers.FloatField(required=False, default=0.0, min_value=0.0, max_value=2.0)
    seed = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=0, max_value=2**63 - 1)


class CalibrateInput(serializers.Serializer):
    prompts = serializers.ListField(child=serializers.JSONField(), min_length=1, max_length=MAX_PROMPTS)
    variant = serializers.DictField(help_text="one variant, as a sweep's")
    target_kl = serializers.FloatField(min_value=0.0, max_value=100.0, help_text="mean KL(steered ‖ default) wanted")
    bounds = serializers.ListField(
        child=serializers.FloatField(), min_length=2, max_length=2, required=False, help_text="[low, high] strengths"
    )
    tolerance = serializers.FloatField(required=False, default=0.01, min_value=1e-9, max_value=100.0)
    max_iterations = serializers.IntegerField(required=False, default=12, min_value=1, max_value=64)
    max_tokens = serializers.IntegerField(required=False, default=32, min_value=1, max_value=MAX_TOKENS)
    temperature = serializers.FloatField(required=False, default=0.0, min_value=0.0, max_value=2.0)
    seed = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=0, max_value=2**63 - 1)
    save_profile = serializers.CharField(
        required=False, allow_null=True, default=None, min_length=1, max_length=100, help_text="a profile's name"
    )


class RunListQuery(serializers.Serializer):
    kind = serializers.ChoiceField(choices=ExperimentRun.Kind.values, required=False)
    sae_id = serializers.CharField(required=False, max_length=200)
    limit, offset = page_fields(50, 200)


class PointsQuery(serializers.Serializer):
    limit, offset = page_fields(100, 1000)


class DownloadQuery(serializers.Serializer):
    format = serializers.ChoiceField(choices=list(exports.FORMATS), required=False, default="jsonl")


# --------------------------------------------------------------------------- outputs


class RunOutput(serializers.Serializer):
    id = serializers.CharField()
    kind = serializers.ChoiceField(choices=ExperimentRun.Kind.values)
    status = serializers.ChoiceField(choices=ExperimentRun.Status.values)
    sae_id = serializers.CharField(allow_null=True)
    layer = serializers.IntegerField(allow_null=True)
    done = serializers.IntegerField()
    total = serializers.IntegerField()
    partial = serializers.BooleanField(help_text="ended before every point was stored; those stored stay")
    error = serializers.JSONField(allow_null=True, help_text="{code, message} of a failed run")
    result = serializers.JSONField(help_text="the kind's figures (a calibration's strength, kl, curve, iterations)")
    spec = serializers.JSONField(help_text="the request as validated")
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


def run_out(run: ExperimentRun) -> dict[str, Any]:
    return output_of(
        RunOutput,
        run,
        sae_id=run.sae_id or None,
        result=run.result or {},
        spec=exports.shown_spec(run.spec or {}),
    )


RunEnvelopeOutput = run_envelope_output(RunOutput)
RunListOutput = listing_output("RunListOutput", "runs", RunOutput)


class PointOutput(serializers.Serializer):
    ordinal = serializers.IntegerField()
    prompt_index = serializers.IntegerField()
    variant_index = serializers.IntegerField(allow_null=True)
    strength = serializers.FloatField(allow_null=True)
    is_default = serializers.BooleanField()
    text = serializers.CharField(allow_blank=True)
    token_ids = serializers.ListField(child=serializers.IntegerField())
    finish_reason = serializers.CharField(allow_blank=True)
    kl_mean = serializers.FloatField(allow_null=True)
    kl_per_position = serializers.ListField(child=serializers.FloatField(), allow_null=True)
    target_before = serializers.FloatField(allow_null=True)
    target_after = serializers.FloatField(allow_null=True)
    target_before_per_position = serializers.JSONField(allow_null=True)
    target_after_per_position = serializers.JSONField(allow_null=True)
    loglik = serializers.FloatField(allow_null=True)
    loglik_per_token = serializers.ListField(child=serializers.FloatField(), allow_null=True)
    data = serializers.JSONField()


def point_out(point: ExperimentPoint) -> dict[str, Any]:
    return PointOutput(point).data


PointListOutput = listing_output("PointListOutput", "points", PointOutput)


# --------------------------------------------------------------------------- views


def start_api(name: str, body: type[serializers.Serializer], start: Callable[..., ExperimentRun], **schema: Any):
    """A start route: the body checked by ``body`` (422 naming the field), the run queued by
    ``start(principal=…, data=…)``, answered 202 ``{run}``."""

    @extend_schema(tags=EXPERIMENTS, request=body, responses={202: enveloped(RunEnvelopeOutput)}, **schema)
    def post(self, request) -> Response:
        data = validated(body, request.data)
        run = start(principal=principal(request), data=dict(data))
        return envelope({"run": run_out(run)}, status_code=status.HTTP_202_ACCEPTED)

    return type(name, (APIView,), {"post": post, "__module__": body.__module__})


SweepStartApi = start_api(
    "SweepStartApi",
    SweepInput,
    services.experiment_sweep_start,
    summary="Start a sweep: prompts × variants × strengths, plus each prompt's unsteered default",
    operation_id="experiments_sweep",
)
CalibrateStartApi = start_api(
    "CalibrateStartApi",
    CalibrateInput,
    services.experiment_calibrate_start,
    summary="Start a calibration: the strength whose mean KL meets target_kl, by bisection",
    operation_id="experiments_calibrate",
)


class ExperimentListApi(APIView):
    @extend_schema(
        tags=EXPERIMENTS,
        summary="Experiments, newest first (an inference key: its own)",
        operation_id="experiments_list",
        parameters=[
            OpenApiParameter("kind", str, required=False, enum=ExperimentRun.Kind.values),
            OpenApiParameter("sae_id", str, required=False),
            OpenApiParameter("limit", int, required=False),
            OpenApiParameter("offset", int, required=False),
        ],
        responses=enveloped(RunListOutput),
    )
    def get(self, request) -> Response:
        query = validated(RunListQuery, request.query_params)
        runs = selectors.experiments_for(principal(request), kind=query.get("kind"), sae_id=query.get("sae_id"))
        return envelope(listing(runs, query, "runs", run_out))


ExperimentDetailApi = run_route(
    "ExperimentDetailApi",
    "get",
    selectors.experiment_get,
    run_out,
    tags=EXPERIMENTS,
    summary="An experiment: status, progress, result",
    operation_id="experiments_get",
    responses=enveloped(RunOutput),
)


class ExperimentPointsApi(APIView):
    @extend_schema(
        tags=EXPERIMENTS,
        summary="An experiment's stored points, by ordinal",
        operation_id="experiments_points",
        parameters=[OpenApiParameter("limit", int, required=False), OpenApiParameter("offset", int, required=False)],
        responses=enveloped(PointListOutput),
    )
    def get(self, request, run_id: str) -> Response:
        query = validated(PointsQuery, request.query_params)
        run = selectors.experiment_get(run_id, principal(request))
        return envelope(listing(selectors.points_of(run), query, "points", point_out))


ExperimentCancelApi = run_route(
    "ExperimentCancelApi",
    "post",
    services.experiment_cancel,
    run_out,
    tags=EXPERIMENTS,
    summary="Cancel a queued or running experiment (the points stored stay; partial)",
    operation_id="experiments_cancel",
    request=None,
    responses=enveloped(RunOutput),
)


class ExperimentDownloadApi(APIView):
    content_negotiation_class = AnyAcceptNegotiation

    @extend_schema(
        tags=EXPERIMENTS,
        summary="An experiment's points as a file: JSONL, CSV or Parquet",
        operation_id="experiments_download",
        parameters=[OpenApiParameter("format", str, required=False, enum=list(exports.FORMATS))],
        responses={
            (200, "application/x-ndjson"): OpenApiTypes.BINARY,
            (200, "text/csv"): OpenApiTypes.BINARY,
            (200, "application/vnd.apache.parquet"): OpenApiTypes.BINARY,
        },
    )
    def get(self, request, run_id: str):  # type: ignore[no-untyped-def]
        from django.http import HttpResponse

        query = validated(DownloadQuery, request.query_params)
        run = selectors.experiment_get(run_id, principal(request))
        body, content_type = exports.export(run, query["format"])
        response = HttpResponse(body, content_type=content_type)
        response["Content-Disposition"] = f'attachment; filename="{run.id}.{query["format"]}"'
        return response
