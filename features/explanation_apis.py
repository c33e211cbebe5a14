"""/api/saes/{sae_id}/explanations: list, write, import (Neuronpedia's export form), export,
delete, and generate with the explainer (docs/api.md "Feature explanations"). Thin views over
``registry.explanations`` and ``features.explainer``. Reading is open to every key; every
change (POST, DELETE) is an admin action (core.auth: no inference-key exception)."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import AnyAcceptNegotiation, JSONBodyParser, envelope, validated
from core.auth import principal
from core.errors import ValidationFailed
from core.schema import MAX_INDEX, enveloped
from features import explainer
from registry import explanations
from registry.labels import explanation_out

EXPLANATIONS = ["explanations"]
_ANY = enveloped(OpenApiTypes.OBJECT)


class ListQuery(serializers.Serializer):
    index = serializers.IntegerField(required=False, min_value=0, max_value=MAX_INDEX)
    limit = serializers.IntegerField(required=False, default=100, min_value=1, max_value=1000)
    offset = serializers.IntegerField(required=False, default=0, min_value=0, max_value=MAX_INDEX)


class CreateInput(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=MAX_INDEX)
    description = serializers.CharField(max_length=explanations.MAX_DESCRIPTION_CHARS, trim_whitespace=True)


class ImportForm(serializers.Serializer):
    file = serializers.FileField(help_text="A Neuronpedia explanations export: a JSON array or JSONL")
    neuronpedia_id = serializers.CharField(
        required=False, allow_blank=True, max_length=300, help_text="model/source of the rows to take"
    )


class ExportQuery(serializers.Serializer):
    format = serializers.ChoiceField(choices=explanations.EXPLANATION_FORMATS, required=False, default="json")


class GenerateInput(serializers.Serializer):
    features = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=MAX_INDEX),
        min_length=1,
        max_length=explainer.MAX_FEATURES,
    )
    score = serializers.BooleanField(required=False, default=False)


class ExplanationListApi(APIView):
    parser_classes = [JSONBodyParser]

    @extend_schema(
        tags=EXPLANATIONS,
        summary="An SAE's explanations (one feature's with ?index=), best first",
        parameters=[
            OpenApiParameter("index", int, required=False),
            OpenApiParameter("limit", int, required=False),
            OpenApiParameter("offset", int, required=False),
        ],
        responses=_ANY,
    )
    def get(self, request, sae_id: str) -> Response:
        query = validated(ListQuery, request.query_params)
        sae = explanations.sae_for_explanations(sae_id)
        rows, total = explanations.explanation_list(
            sae=sae, index=query.get("index"), limit=query["limit"], offset=query["offset"]
        )
        return envelope({"explanations": rows, "total": total})

    @extend_schema(
        tags=EXPLANATIONS,
        summary="Write one feature's explanation (source user; admin key)",
        request=CreateInput,
        responses={201: _ANY},
    )
    def post(self, request, sae_id: str) -> Response:
        sae = explanations.sae_for_explanations(sae_id)
        data = validated(CreateInput, request.data if isinstance(request.data, dict) else {"body": None})
        row = explanations.explanation_create(
            sae=sae, index=data["index"], description=data["description"], created_by=principal(request).owner
        )
        return envelope(explanation_out(row), status_code=status.HTTP_201_CREATED)


class ExplanationImportApi(APIView):
    parser_classes = [MultiPartParser, FormParser, JSONBodyParser]

    @extend_schema(
        tags=EXPLANATIONS,
        summary="Import Neuronpedia's explanations export (multipart file, or the JSON array as the body; admin key)",
        request={"multipart/form-data": ImportForm, "application/json": OpenApiTypes.OBJECT},
        parameters=[OpenApiParameter("neuronpedia_id", str, required=False)],
        responses=_ANY,
    )
    def post(self, request, sae_id: str) -> Response:
        sae = explanations.sae_for_explanations(sae_id)
        target = request.query_params.get("neuronpedia_id", "")
        filename = ""
        if request.content_type and request.content_type.startswith(("multipart/", "application/x-www-form")):
            form = validated(ImportForm, request.data)
            upload = form["file"]
            if upload.size > explanations.MAX_IMPORT_BYTES:
                raise explanations.PayloadTooLarge(
                    f"The explanations file is larger than {explanations.MAX_IMPORT_BYTES} bytes",
                    details={"limit_bytes": explanations.MAX_IMPORT_BYTES, "param": "file"},
                )
            data = upload.read(explanations.MAX_IMPORT_BYTES + 1)
            filename = upload.name or ""
            target = form.get("neuronpedia_id") or target
        else:
            # the export itself as the JSON body (an array, or an object with explanations)
            data = request.body
        if not data:
            raise ValidationFailed("No explanations were sent", details={"fields": {"file": ["required"]}})
        result = explanations.explanations_import(
            sae=sae, data=data, neuronpedia_id=target, created_by=principal(request).owner, filename=filename
        )
        return envelope(result)


class ExplanationExportApi(APIView):
    content_negotiation_class = AnyAcceptNegotiation

    @extend_schema(
        tags=EXPLANATIONS,
        summary="Every explanation in Neuronpedia's export form (no envelope)",
        parameters=[OpenApiParameter("format", str, required=False, enum=list(explanations.EXPLANATION_FORMATS))],
        responses={(200, "application/json"): OpenApiTypes.OBJECT},
    )
    def get(self, request, sae_id: str):  # type: ignore[no-untyped-def]
        query = validated(ExportQuery, request.query_params)
        sae = explanations.sae_for_explanations(sae_id)
        fmt = query["format"]
        body = explanations.export_bytes(sae, fmt)
        response = HttpResponse(
            body, content_type="application/x-ndjson" if fmt == "jsonl" else "application/json; charset=utf-8"
        )
        response["Content-Disposition"] = f'attachment; filename="{sae.id}.explanations.{fmt}"'
        return response


class ExplanationDetailApi(APIView):
    @extend_schema(tags=EXPLANATIONS, summary="Delete one explanation (admin key)", responses=_ANY)
    def delete(self, request, sae_id: str, explanation_id: str) -> Response:
        sae = explanations.sae_for_explanations(sae_id)
        explanations.explanation_delete(sae=sae, explanation_id=int(explanation_id))
        return envelope({"status": "deleted", "id": int(explanation_id)})


class ExplanationGenerateApi(APIView):
    parser_classes = [JSONBodyParser]

    @extend_schema(
        tags=EXPLANATIONS,
        summary="Explain (and score) features with the explainer model, in the request (admin key)",
        request=GenerateInput,
        responses=_ANY,
    )
    def post(self, request, sae_id: str) -> Response:
        sae = explanations.sae_for_explanations(sae_id)
        data = validated(GenerateInput, request.data if isinstance(request.data, dict) else {"body": None})
        return envelope(
            explainer.generate(
                sae=sae, features=data["features"], score=data["score"], created_by=principal(request).owner
            )
        )
