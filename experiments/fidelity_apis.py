"""The corpus SAE fidelity routes (docs/api.md, "Experiments"; docs/experiments.md, "SAE
fidelity"): ``POST /api/experiments/fidelity`` starts a ``fidelity`` run (checked by
``experiments.fidelity.fidelity_check``, queued by ``experiments.services.experiment_start``;
it is then read, listed, cancelled and downloaded as every experiment is), and ``GET
/api/saes/{id}/fidelity`` answers the SAE's newest complete corpus fidelity the caller may
read. Thin views: a serializer checks the body or query (422 VALIDATION_ERROR naming the
field), one service or selector does the rest."""

from __future__ import annotations

from typing import Any

from django.db.models import Q
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import audited
from core.api import envelope, validated
from core.auth import Principal, principal
from core.run_apis import layer_field
from core.schema import MAX_LAYER, enveloped
from experiments.apis import EXPERIMENTS, start_api
from experiments.fidelity import DENSE_THRESHOLD
from experiments.models import ExperimentRun
from experiments.services import run_target, spec_params
from features.corpus_options import CorpusChecks, corpus_fields


class FidelityStartInput(CorpusChecks, serializers.Serializer):
    sae_id = serializers.RegexField(r"^sae_[A-Za-z0-9_.-]{1,36}$", max_length=40, help_text="the SAE's id; attached")
    layer = layer_field()
    corpus = serializers.ChoiceField(choices=["sample", "file"], required=False, default="sample")
    file_id, text_field, token_budget, context_tokens = corpus_fields()
    dense_threshold = serializers.FloatField(
        required=False,
        default=DENSE_THRESHOLD,
        min_value=1e-6,
        max_value=1.0,
        help_text="a feature firing on more than this share of the tokens is dense",
    )


class FidelityQuery(serializers.Serializer):
    layer = serializers.IntegerField(required=False, min_value=0, max_value=MAX_LAYER)


class SaeFidelityOutput(serializers.Serializer):
    sae_id = serializers.CharField()
    run_id = serializers.CharField(allow_null=True, help_text="the run the figures are from; null: none yet")
    layer = serializers.IntegerField(allow_null=True)
    corpus = serializers.JSONField(allow_null=True, help_text="{corpus, file_id?, token_budget, context_tokens}")
    finished_at = serializers.DateTimeField(allow_null=True)
    fidelity = serializers.JSONField(
        allow_null=True,
        help_text="the run's figures: rows, l0, l0_distribution, mse, explained_variance, loss_clean, "
        "loss_spliced, loss_zero, loss_recovered (null with loss_recovered_unavailable), dead and dense "
        "features; null: no complete run the caller may read",
    )


def visible_runs(who: Principal | None) -> Q:
    """The fidelity runs whose figures a caller may read, as a dashboard's: a run over the
    sample corpus is everyone's, a run over a /v1 file its owner's (as the file is); an
    admin key, and the server itself (None), read all."""
    if who is None or who.admin:
        return Q()
    return ~Q(spec__corpus="file") | Q(owner=who.owner)


def latest_fidelity(sae_id: str, who: Principal | None, layer: int | None = None) -> ExperimentRun | None:
    """The SAE's newest complete corpus fidelity run the caller may read (at ``layer``)."""
    query = ExperimentRun.objects.filter(
        visible_runs(who),
        kind=ExperimentRun.Kind.FIDELITY,
        status=ExperimentRun.Status.COMPLETED,
        sae_id=sae_id,
    )
    if layer is not None:
        query = query.filter(layer=layer)
    return query.order_by("-finished_at", "-created_at", "-id").first()


@audited("experiment.fidelity", run_target, params=spec_params)
def fidelity_start(*, data: dict[str, Any], who: Principal) -> ExperimentRun:
    """Check a corpus fidelity run (``FidelityStartInput``'s data) against the engine's
    state and queue it: the route's and ``manage.py fidelity``'s one way in."""
    from core.runtime import runtime
    from experiments.fidelity import fidelity_check
    from experiments.services import experiment_start

    from registry.engines import addressing_sae

    with addressing_sae(str(data.get("sae_id") or "")):  # the engine of the SAE's model
        status = runtime().engine.status()
    plan = fidelity_check(data=dict(data), status=status, principal=who)
    return experiment_start(
        kind=ExperimentRun.Kind.FIDELITY,
        spec=plan.spec,
        principal=who,
        total=plan.total,
        sae_id=plan.sae_id,
        layer=plan.layer,
    )


def sae_fidelity(sae_id: str, who: Principal | None, layer: int | None = None) -> dict[str, Any]:
    """``GET /api/saes/{id}/fidelity``'s answer (``SaeFidelityOutput``): the SAE's newest
    complete corpus fidelity the caller may read, all null when none (404 for an unknown
    SAE); ``manage.py fidelity SAE --show`` prints the same."""
    from registry.selectors import sae_get

    sae_get(sae_id=sae_id)  # 404 for an unknown SAE
    run = latest_fidelity(sae_id, who, layer)
    if run is None:
        out = {
            "sae_id": sae_id,
            "run_id": None,
            "layer": None,
            "corpus": None,
            "finished_at": None,
            "fidelity": None,
        }
    else:
        spec = run.spec or {}
        corpus = {k: spec[k] for k in ("corpus", "file_id", "token_budget", "context_tokens") if k in spec}
        out = {
            "sae_id": sae_id,
            "run_id": run.id,
            "layer": run.layer,
            "corpus": corpus,
            "finished_at": run.finished_at,
            "fidelity": run.result,
        }
    return SaeFidelityOutput(out).data


FidelityStartApi = start_api(
    "FidelityStartApi",
    FidelityStartInput,
    lambda principal, data: fidelity_start(data=data, who=principal),
    summary="Start a corpus SAE fidelity run: L0, MSE, explained variance, loss recovered, dead and dense features",
    operation_id="experiments_fidelity",
)


class SaeFidelityApi(APIView):
    @extend_schema(
        tags=EXPERIMENTS,
        summary="The SAE's newest complete corpus fidelity (null when none)",
        operation_id="saes_fidelity",
        parameters=[OpenApiParameter("layer", int, required=False)],
        responses=enveloped(SaeFidelityOutput),
    )
    def get(self, request, sae_id: str) -> Response:
        query = validated(FidelityQuery, request.query_params)
        return envelope(sae_fidelity(sae_id, principal(request), query.get("layer")))
