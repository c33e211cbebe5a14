"""/api/vectors: raw steering vectors (list, upload, get, delete). Thin views over
``registry.vectors``; computing one on the resident model is ``orchestration.apis``."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import JSONBodyParser, envelope, validated
from core.schema import enveloped
from registry import selectors, services, vector_io, vectors
from registry import outputs

VECTORS = ["vectors"]


class VectorListCreateApi(APIView):
    parser_classes = [MultiPartParser, FormParser, JSONBodyParser]

    @extend_schema(
        tags=VECTORS,
        summary="List steering vectors",
        operation_id="vectors_list",
        responses=enveloped(vector_io.VectorListOutput),
    )
    def get(self, request) -> Response:
        rows = list(vectors.vector_list().prefetch_related("attachments"))
        return envelope({"vectors": [vector_io.vector_out(v) for v in rows], "total": len(rows)})

    @extend_schema(
        tags=VECTORS,
        summary="Upload a steering vector file (multipart: file, name, model, layer?)",
        operation_id="vectors_upload",
        request={"multipart/form-data": vector_io.VectorUploadInput},
        responses={201: enveloped(vector_io.VectorOutput)},
    )
    def post(self, request) -> Response:
        data = validated(vector_io.VectorUploadInput, request.data)
        upload = data["file"]
        row = vectors.vector_upload(
            chunks=upload.chunks(),
            size=upload.size,
            name=data["name"],
            model=selectors.model_get(model_id=data["model"]),
            layer=data.get("layer"),
        )
        return envelope(vector_io.vector_out(row), status_code=status.HTTP_201_CREATED)


class VectorDetailApi(APIView):
    @extend_schema(tags=VECTORS, summary="One steering vector", responses=enveloped(vector_io.VectorOutput))
    def get(self, request, vector_id: str) -> Response:
        return envelope(vector_io.vector_out(vectors.vector_get(vector_id=vector_id)))

    @extend_schema(
        tags=VECTORS,
        summary="Delete a steering vector and the copy miLLM wrote (409 while attached)",
        responses=enveloped(outputs.DeleteOutput),
    )
    def delete(self, request, vector_id: str) -> Response:
        services.sae_delete(sae=vectors.vector_get(vector_id=vector_id))
        return envelope({"status": "deleted", "id": vector_id, "freed_disk_mb": None})
