"""/api/models, /api/saes and /api/jobs: thin views, one per action. Each validates its
input with a serializer, calls one service or selector, and answers the envelope; every
refusal is an exception the /api exception handler turns into the error envelope."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope, validated
from core.engines import DEFAULT_ENGINE, primary_engine
from core.schema import enveloped
from registry import access, describe, downloads, job_lifecycle, outputs, selectors, services
from registry import serializers as io
from registry.models import Attachment, Model

MODELS, SAES, JOBS = ["models"], ["saes"], ["jobs"]


# --- models --------------------------------------------------------------------------------


class ModelListCreateApi(APIView):
    @extend_schema(
        tags=MODELS, summary="List models", operation_id="models_list", responses=enveloped(outputs.ModelListOutput)
    )
    def get(self, request) -> Response:
        progress = selectors.download_progress_by_model()
        models = list(selectors.model_list())
        # every engine's loaded model (ENGINE_MODELS; a row from before engines had names
        # is the default engine's); loaded_model_id stays the default engine's
        # (ENGINE_MODELS' first where it does not list default)
        loaded_models = {
            m.engine or DEFAULT_ENGINE: m.id
            for m in sorted(models, key=lambda m: m.id)
            if m.status == Model.Status.LOADED
        }
        return envelope(
            {
                "models": [outputs.model_out(m, download_progress=progress.get(m.id)) for m in models],
                "total": len(models),
                "loaded_model_id": loaded_models.get(primary_engine()),
                "loaded_models": loaded_models,
            }
        )

    @extend_schema(
        tags=MODELS,
        summary="Download a model from the hub (202) or register a local checkpoint (201)",
        request=io.ModelCreateInput,
        responses={201: enveloped(outputs.ModelJobOutput), 202: enveloped(outputs.ModelJobOutput)},
    )
    def post(self, request) -> Response:
        data = validated(io.ModelCreateInput, request.data)
        if data["source"] == Model.Source.LOCAL:
            access.require_admin(request, "registering a checkpoint from the server's disk")
        access.check_remote_code(trust_remote_code=data["trust_remote_code"], admin=access.caller_is_admin(request))
        if data["source"] == Model.Source.LOCAL:
            model = services.model_register_local(
                local_path=data["local_path"],
                name=data.get("custom_name") or None,
                quantization=data["quantization"],
                trust_remote_code=data["trust_remote_code"],
                backend=data["backend"],
            )
            return envelope({"model": outputs.model_view(model), "job": None}, status_code=status.HTTP_201_CREATED)
        services.check_backend_name(data["backend"])  # before anything starts
        model, job = downloads.model_download_start(
            repo_id=data["repo_id"],
            revision=data.get("revision") or "main",
            quantization=data["quantization"],
            trust_remote_code=data["trust_remote_code"],
            custom_name=data.get("custom_name") or None,
            hf_token=data.get("hf_token") or None,
            backend=data["backend"],
        )
        if data["backend"]:
            model = services.model_set_backend(model=model, backend=data["backend"])
        return envelope(
            {"model": outputs.model_view(model), "job": outputs.job_out(job)}, status_code=status.HTTP_202_ACCEPTED
        )


class ModelPreviewApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="Preview a hub model: size, architecture, memory estimates per quantization",
        request=io.ModelPreviewInput,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request) -> Response:
        data = validated(io.ModelPreviewInput, request.data)
        return envelope(
            downloads.model_preview(
                repo_id=data["repo_id"], revision=data.get("revision") or "main", hf_token=data.get("hf_token") or None
            )
        )


class ModelDetailApi(APIView):
    @extend_schema(tags=MODELS, summary="Model details", responses=enveloped(outputs.ModelOutput))
    def get(self, request, model_id: int) -> Response:
        return envelope(outputs.model_view(selectors.model_get(model_id=model_id)))

    @extend_schema(
        tags=MODELS,
        summary="Change a model's settings (its backend); refused while it is loaded",
        request=io.ModelUpdateInput,
        responses=enveloped(outputs.ModelOutput),
    )
    def patch(self, request, model_id: int) -> Response:
        data = validated(io.ModelUpdateInput, request.data)
        model = services.model_set_backend(model=selectors.model_get(model_id=model_id), backend=data["backend"])
        return envelope(outputs.model_view(model))

    @extend_schema(
        tags=MODELS,
        summary="Delete a model (files and row); refused while loaded or locked",
        responses=enveloped(outputs.ModelDeleteOutput),
    )
    def delete(self, request, model_id: int) -> Response:
        model = selectors.model_get(model_id=model_id)
        size = model.disk_size_bytes if model.source == Model.Source.HUGGINGFACE else None
        services.model_delete(model=model)
        return envelope(
            {"status": "deleted", "id": model_id, "freed_disk_mb": None if size is None else round(size / 2**20, 3)}
        )


class ModelLockApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="Lock: refuse unload, delete and swaps",
        request=None,
        responses=enveloped(outputs.ModelOutput),
    )
    def post(self, request, model_id: int) -> Response:
        model = services.model_lock(model=selectors.model_get(model_id=model_id))
        return envelope(outputs.model_view(model))


class ModelUnlockApi(APIView):
    @extend_schema(tags=MODELS, summary="Unlock", request=None, responses=enveloped(outputs.ModelOutput))
    def post(self, request, model_id: int) -> Response:
        model = services.model_unlock(model=selectors.model_get(model_id=model_id))
        return envelope(outputs.model_view(model))


class ModelCancelApi(APIView):
    @extend_schema(
        tags=MODELS,
        summary="Cancel the model's download in progress",
        request=None,
        responses=enveloped(outputs.ModelJobOutput),
    )
    def post(self, request, model_id: int) -> Response:
        model = selectors.model_get(model_id=model_id)
        job = downloads.download_cancel(row=model)
        model.refresh_from_db()
        return envelope({"model": outputs.model_view(model), "job": outputs.job_out(job)})


# --- SAEs ------------------------------------------------------------------------------------


def _layers_by_sae() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for sae_id, layer in Attachment.objects.values_list("sae_id", "layer").order_by("layer"):
        out.setdefault(sae_id, []).append(layer)
    return out


def _sae_data(sae) -> dict:
    layers = list(sae.attachments.order_by("layer").values_list("layer", flat=True))
    return outputs.sae_out(sae, layers=layers, download_progress=selectors.download_progress_by_sae().get(sae.id))


class SAEListApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="List SAEs and the attachment status",
        operation_id="saes_list",
        responses=enveloped(outputs.SAEListOutput),
    )
    def get(self, request) -> Response:
        layers = _layers_by_sae()
        progress = selectors.download_progress_by_sae()
        saes = list(selectors.sae_list())
        rows = list(selectors.attachment_list())
        counts = selectors.engine_attachment_counts() if rows else {}
        return envelope(
            {
                "saes": [
                    outputs.sae_out(s, layers=layers.get(s.id), download_progress=progress.get(s.id)) for s in saes
                ],
                "total": len(saes),
                "attachment": outputs.attachment_status(rows, counts),
            }
        )

    @extend_schema(
        tags=SAES,
        summary="Register an SAE from a local directory (201) or "
        "download one from the hub (202, as /api/saes/download)",
        operation_id="saes_create",
        request=io.SAECreateInput,
        responses={201: enveloped(outputs.SAEDownloadOutput), 202: enveloped(outputs.SAEDownloadOutput)},
    )
    def post(self, request) -> Response:
        data = validated(io.SAECreateInput, request.data)
        if data["source"] == "local":
            access.require_admin(request, "registering an SAE from the server's disk")
            sae = services.sae_register_local(
                local_path=data["local_path"],
                name=data.get("name") or None,
                trained_on_model=data.get("trained_on") or None,
                trained_on_layer=data.get("trained_layer"),
            )
            return envelope(
                {
                    "sae_id": sae.id,
                    "status": "registered",
                    "message": f"Registered from {sae.local_path}",
                    "sae": _sae_data(sae),
                    "job": None,
                },
                status_code=status.HTTP_201_CREATED,
            )
        return _download(data)


def _download(data: dict) -> Response:
    sae, job, state = downloads.sae_download_start(
        repository_id=data["repository_id"],
        file_path=data.get("file_path") or "",
        revision=data.get("revision") or "main",
        hf_token=data.get("hf_token") or None,
    )
    messages = {
        "downloading": "Download started",
        "cached": "Already downloaded",
        "attached": "Already downloaded and attached",
        "already_downloading": "A download of this SAE is in progress",
    }
    return envelope(
        {
            "sae_id": sae.id,
            "status": state,
            "message": messages[state],
            "sae": _sae_data(sae),
            "job": outputs.job_out(job),
        },
        status_code=status.HTTP_202_ACCEPTED,
    )


class SAEDownloadApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Download an SAE (idempotent per repository, revision and file path)",
        request=io.SAEDownloadInput,
        responses={202: enveloped(outputs.SAEDownloadOutput)},
    )
    def post(self, request) -> Response:
        return _download(validated(io.SAEDownloadInput, request.data))


class SAEPreviewApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="List the SAE files of a hub repository",
        request=io.SAEPreviewInput,
        responses=enveloped(OpenApiTypes.OBJECT),
    )
    def post(self, request) -> Response:
        data = validated(io.SAEPreviewInput, request.data)
        return envelope(
            downloads.sae_preview(
                repository_id=data["repository_id"],
                revision=data.get("revision") or "main",
                hf_token=data.get("hf_token") or None,
            )
        )


class AttachmentListApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Every attachment (one per sae_id and layer): is_attached, count, entries, total_memory_usage_mb",
        responses=enveloped(outputs.AttachmentsOutput),
    )
    def get(self, request) -> Response:
        rows = list(selectors.attachment_list())
        counts = selectors.engine_attachment_counts() if rows else {}
        return envelope(outputs.attachments_out(rows, counts))


class SAEDetailApi(APIView):
    @extend_schema(tags=SAES, summary="SAE details", responses=enveloped(outputs.SAEOutput))
    def get(self, request, sae_id: str) -> Response:
        return envelope(_sae_data(selectors.sae_get(sae_id=sae_id)))

    @extend_schema(tags=SAES, summary="Delete an SAE (409 while attached)", responses=enveloped(outputs.DeleteOutput))
    def delete(self, request, sae_id: str) -> Response:
        sae = selectors.sae_get(sae_id=sae_id)
        size = None
        if sae.repository_id and sae.local_path:
            from pathlib import Path

            size = describe.dir_size(Path(sae.local_path)) if Path(sae.local_path).exists() else None
        services.sae_delete(sae=sae)
        return envelope(
            {"status": "deleted", "id": sae_id, "freed_disk_mb": None if size is None else round(size / 2**20, 3)}
        )


class SAECancelApi(APIView):
    @extend_schema(
        tags=SAES,
        summary="Cancel the SAE's download in progress",
        request=None,
        responses=enveloped(outputs.SAEDownloadOutput),
    )
    def post(self, request, sae_id: str) -> Response:
        sae = selectors.sae_get(sae_id=sae_id)
        job = downloads.download_cancel(row=sae)
        sae.refresh_from_db()
        return envelope(
            {
                "sae_id": sae.id,
                "status": sae.status,
                "message": "Download cancelled",
                "sae": _sae_data(sae),
                "job": outputs.job_out(job),
            }
        )


# --- jobs ------------------------------------------------------------------------------------


class JobListApi(APIView):
    @extend_schema(
        tags=JOBS,
        summary="Recent jobs (downloads, loads, unloads)",
        operation_id="jobs_list",
        parameters=[io.JobListQuery],
        responses=enveloped(outputs.JobListOutput),
    )
    def get(self, request) -> Response:
        query = validated(io.JobListQuery, request.query_params)
        rows = selectors.job_list(kind=query.get("kind"), status=query.get("status"), limit=query["limit"])
        return envelope({"jobs": [outputs.job_out(j) for j in rows], "total": len(rows)})


class JobDetailApi(APIView):
    @extend_schema(tags=JOBS, summary="One job's progress", responses=enveloped(outputs.JobOutput))
    def get(self, request, job_id: int) -> Response:
        return envelope(outputs.job_out(selectors.job_get(job_id=job_id)))


class JobCancelApi(APIView):
    @extend_schema(
        tags=JOBS, summary="Cancel a queued or running job", request=None, responses=enveloped(outputs.JobOutput)
    )
    def post(self, request, job_id: int) -> Response:
        with transaction.atomic():
            job = selectors.job_get(job_id=job_id)
            if job.model_id and job.kind == "model_download":
                job = downloads.download_cancel(row=job.model)
            elif job.sae_id and job.kind == "sae_download":
                job = downloads.download_cancel(row=job.sae)
            else:
                job = job_lifecycle.job_cancel(job=job)
        return envelope(outputs.job_out(job))
