"""/api routes that change what the engine holds: load and unload a model, attach and
detach SAEs, the attachment status and the compatibility dry run. Thin views over
``orchestration.services``; the registry's own routes (rows, downloads, jobs) are
``registry.apis``."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope, validated
from core.auth import require_admin
from core.schema import enveloped
from orchestration import engines, services, vectors
from registry import outputs, selectors, vector_io
from registry import serializers as io
from registry.models import Attachment
from steering import serializers as steering_io
from steering import services as steering_services

MODELS, SAES = ["models"], ["saes"]


def _enqueued(request, model_id: int, enqueue) -> Response:
    """202 with the model as it now stands and the load or unload job (the request's
    ``X-miLLM-Lease`` decides over a leased model)."""
    model = selectors.model_get(model_id=model_id)
    job = enqueue(model=model, lease_id=request.headers.get("X-miLLM-Lease"))
    model.refresh_from_db()
    return envelope(
        {"model": outputs.model_view(model), "job": outputs.job_out(job)}, status_code=status.HTTP_202_ACCEPTED
    )


class ModelLoadApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="Load a model in the background (202 + job; model:load:* events)",
        request=None,
        responses={202: enveloped(outputs.ModelJobOutput)},
    )
    def post(self, request, model_id: int) -> Response:
        return _enqueued(request, model_id, services.model_load_enqueue)


class ModelUnloadApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="Unload the model in the background after running requests finish (GRACEFUL_UNLOAD_TIMEOUT)",
        request=None,
        responses={202: enveloped(outputs.ModelJobOutput)},
    )
    def post(self, request, model_id: int) -> Response:
        return _enqueued(request, model_id, services.model_unload_enqueue)


class EngineListApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="The engines the front routes to and what each holds (admin keys only)",
        operation_id="engine_list",
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def get(self, request) -> Response:
        require_admin(request, "listing the engines")
        return envelope({"engines": engines.engines_report()})


class AttachmentStatusApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Attachment status (with steering_apply_count)",
        responses=enveloped(outputs.AttachmentStatusOutput),
    )
    def get(self, request) -> Response:
        rows = list(selectors.attachment_list())
        return envelope(outputs.attachment_status(rows, selectors.engine_attachment_counts() if rows else {}))


def _attach_data(result, sae, state: str) -> dict:
    return {
        "status": state,
        "sae_id": result.sae_id,
        "layer": result.layer,
        "layer_module_path": result.layer_module_path,
        "hook_point": result.hook_point,
        "memory_usage_mb": outputs.sae_out(sae)["memory_usage_mb"],
        "warnings": list(result.warnings),
    }


class AttachSetApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Attach several SAEs at once, all or nothing (idempotent per sae_id and layer)",
        request=io.AttachSetInput,
        responses=enveloped(outputs.AttachSetOutput),
    )
    def post(self, request) -> Response:
        data = validated(io.AttachSetInput, request.data)
        saes = {item["sae_id"]: selectors.sae_get(sae_id=item["sae_id"]) for item in data["attachments"]}
        before = set(Attachment.objects.values_list("sae_id", "layer"))
        results = services.sae_attach_set(items=[(saes[i["sae_id"]], i["layer"]) for i in data["attachments"]])
        out = [
            _attach_data(r, saes[r.sae_id], "already_attached" if (r.sae_id, r.layer) in before else "attached")
            for r in results
        ]
        return envelope({"attachments": out, "total": len(out)})


class SAECompatibilityApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Dry-run compatibility with the loaded model",
        parameters=[OpenApiParameter("layer", int, required=True)],
        responses=enveloped(outputs.CompatibilityOutput),
    )
    def get(self, request, sae_id: str) -> Response:
        query = validated(io.CompatibilityQuery, request.query_params)
        sae = selectors.sae_get(sae_id=sae_id)
        report = services.sae_check_compatibility(sae=sae, layer=query["layer"])
        resident = selectors.model_loaded()
        return envelope(
            {**report, "sae_id": sae.id, "layer": query["layer"], "model_id": resident.id if resident else None}
        )


class SAEAttachApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Attach to the loaded model at a layer",
        request=io.AttachInput,
        responses=enveloped(outputs.AttachOutput),
    )
    def post(self, request, sae_id: str) -> Response:
        data = validated(io.AttachInput, request.data)
        sae = selectors.sae_get(sae_id=sae_id)
        result = services.sae_attach(sae=sae, layer=data["layer"])
        return envelope(_attach_data(result, sae, "attached"))


class SAEDetachApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Detach (one layer, or every layer of this SAE)",
        request=io.DetachInput,
        responses=enveloped(outputs.DetachOutput),
    )
    def post(self, request, sae_id: str) -> Response:
        data = validated(io.DetachInput, request.data or {})
        sae = selectors.sae_get(sae_id=sae_id)
        keys = services.sae_detach(sae=sae, layer=data.get("layer"))
        layers = sorted({layer for _, layer in keys}) or ([data["layer"]] if data.get("layer") is not None else [])
        memory = outputs.sae_out(sae)["memory_usage_mb"]
        return envelope({"status": "detached", "sae_id": sae.id, "layers": layers, "memory_freed_mb": memory})


class CircuitActivateApi(APIView):
    @extend_schema(
        tags=["circuits"],
        summary="Activate: attach every member SAE and steer every layer under one λ",
        request=steering_io.CircuitActivateInput,
        parameters=[
            OpenApiParameter("acknowledge_unvalidated", bool, required=False),
            OpenApiParameter("allow_layer_overlap", bool, required=False),
        ],
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request, circuit_id: str) -> Response:
        circuit = steering_services.circuit_get(circuit_id=circuit_id)
        data = validated(steering_io.CircuitActivateInput, {**request.query_params.dict(), **body_object(request)})
        circuit = services.circuit_activate(
            circuit=circuit,
            acknowledge_unvalidated=data["acknowledge_unvalidated"],
            allow_layer_overlap=data["allow_layer_overlap"],
            intensity=data.get("intensity"),
        )
        out = steering_io.circuit_out(circuit)
        if data["allow_layer_overlap"]:
            out["allowed_layer_overlap"] = True
        return envelope(out)


class VectorComputeApi(APIView):
    @extend_schema(
        tags=["vectors"],
        summary="Compute a steering vector on the resident model "
        "from contrastive prompt pairs (mean difference of block outputs)",
        operation_id="vectors_compute",
        request=vector_io.VectorComputeInput,
        responses={201: enveloped(vector_io.VectorOutput)},
    )
    def post(self, request) -> Response:
        data = validated(vector_io.VectorComputeInput, body_object(request))
        row = vectors.vector_compute(
            name=data["name"],
            layer=data["layer"],
            model_name=data.get("model") or None,
            pairs=[(p["positive"], p["negative"]) for p in data["pairs"]],
            pooling=data["pooling"],
        )
        return envelope(vector_io.vector_out(row), status_code=status.HTTP_201_CREATED)
