"""/api/probes: create, import, list, get, delete, validate, arm and disarm probes
(docs/monitoring.md, "Probes"). Thin views over ``monitoring.probes``."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope, validated
from core.engines import current_engine, several_engines
from core.runtime import runtime
from core.schema import enveloped
from monitoring import probes
from monitoring.errors import ProbeInvalid
from monitoring.ownership import Scope
from registry.engines import addressing_model, engine_status_of, sae_engine

PROBES = ["probes"]
_ANY = enveloped(OpenApiTypes.OBJECT)


def _engine(row) -> str | None:  # type: ignore[no-untyped-def]
    """With several engines, the engine a probe is read against (registry.engines): that of
    the model it was last validated on, else that of its SAE's model, else the default one
    (a residual-stream probe never validated)."""
    if not several_engines():
        return None
    model = (row.validation or {}).get("model")
    if model:
        with addressing_model(str(model)):
            return current_engine()
    return sae_engine(row.sae_id or None)


def _status(row=None, cache=None):  # type: ignore[no-untyped-def]
    if row is None:
        return runtime().engine.status()
    return engine_status_of(_engine(row), cache)


class ImportInput(serializers.Serializer):
    file = serializers.FileField()
    name = serializers.CharField(required=False, max_length=120)
    sae_id = serializers.CharField(required=False, max_length=40)
    layer = serializers.IntegerField(required=False, min_value=0)
    threshold = serializers.FloatField(required=False)
    positions = serializers.ChoiceField(choices=probes.POSITIONS, required=False)
    description = serializers.CharField(required=False, allow_blank=True)


class ProbeListApi(APIView):
    parser_classes = [JSONParser]

    @extend_schema(
        tags=PROBES, summary="Probes, with whether each is validated against the resident model", responses=_ANY
    )
    def get(self, request) -> Response:
        cache: dict = {}
        return envelope(probes.probe_list(status_of=lambda row: _status(row, cache), scope=Scope.of_request(request)))

    @extend_schema(
        tags=PROBES,
        summary="Create a probe from its definition (weights, bias, "
        "threshold, layer, basis, features, norm_mean/norm_std, positions)",
        request=OpenApiTypes.OBJECT,
        responses=_ANY,
    )
    def post(self, request) -> Response:
        row = probes.probe_create(definition=body_object(request), owner=Scope.of_request(request).owner)
        return envelope(probes.probe_out(row, _status(row)), status_code=201)


class ProbeImportApi(APIView):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(
        tags=PROBES,
        summary="Import a trained probe file (.json or .npz, never unpickled); form fields fill or override the file's",
        request={"multipart/form-data": ImportInput},
        responses=_ANY,
    )
    def post(self, request) -> Response:
        data = validated(ImportInput, request.data)
        upload = data.pop("file")
        if upload.size > probes.MAX_FILE_BYTES:
            raise ProbeInvalid(f"the file is larger than {probes.MAX_FILE_BYTES} bytes", details={"field": "file"})
        row = probes.probe_import(
            filename=upload.name or "", content=upload.read(), overrides=data, owner=Scope.of_request(request).owner
        )
        return envelope(probes.probe_out(row, _status(row)), status_code=201)


class ProbeDetailApi(APIView):
    @extend_schema(tags=PROBES, summary="A probe (by id or name)", responses=_ANY)
    def get(self, request, ref: str) -> Response:
        row = probes.probe_get(ref=ref, scope=Scope.of_request(request))
        return envelope({**probes.probe_out(row, _status(row)), "weights": row.weights})

    @extend_schema(tags=PROBES, summary="Delete a probe (its verdict history is kept)", responses=_ANY)
    def delete(self, request, ref: str) -> Response:
        probes.probe_delete(ref=ref, scope=Scope.of_request(request))
        return envelope({"deleted": ref})


class ProbeValidateApi(APIView):
    @extend_schema(tags=PROBES, summary="Validate against the resident model and SAE", responses=_ANY)
    def post(self, request, ref: str) -> Response:
        status = _status(probes.probe_get(ref=ref, scope=Scope.of_request(request)))
        row = probes.probe_validate(ref=ref, status=status, scope=Scope.of_request(request))
        return envelope(probes.probe_out(row, status))


class ProbeArmApi(APIView):
    armed = True

    @extend_schema(
        tags=PROBES, summary="Arm: score on every /v1 request that brings no `probes` (all web workers)", responses=_ANY
    )
    def post(self, request, ref: str) -> Response:
        status = _status(probes.probe_get(ref=ref))
        row = probes.probe_arm(ref=ref, armed=self.armed, status=status)
        return envelope(probes.probe_out(row, status))


class ProbeDisarmApi(ProbeArmApi):
    armed = False

    @extend_schema(tags=PROBES, summary="Disarm", responses=_ANY)
    def post(self, request, ref: str) -> Response:
        return super().post(request, ref)
