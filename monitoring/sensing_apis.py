"""/api/monitoring/sensing: arm, disarm and list the clusters and circuits watched for
co-firing (docs/monitoring.md, "Sensing"). Thin views over ``monitoring.sensing``."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope
from core.engines import several_engines
from core.runtime import runtime
from core.schema import enveloped
from monitoring import sensing
from registry.engines import engine_status_of, saes_engine

TAGS = ["monitoring"]
_ANY = enveloped(OpenApiTypes.OBJECT)


def _status():  # type: ignore[no-untyped-def]

    return runtime().engine.status()


def _status_of():  # type: ignore[no-untyped-def]
    """With several engines, each watched document's status is that of the engine holding
    its members' SAEs (registry.engines); None with one engine."""
    if not several_engines():
        return None
    cache: dict = {}
    return lambda watch: engine_status_of(saes_engine([m.sae_id for m in watch.members]), cache)


def _ref(request) -> tuple[object, object]:  # type: ignore[no-untyped-def]
    data = dict(body_object(request))
    for key in ("kind", "id"):  # DELETE may send them as query parameters
        if key not in data and key in request.query_params:
            data[key] = request.query_params[key]
    return data.get("kind"), data.get("id")


class SensingApi(APIView):
    parser_classes = [JSONParser]

    @extend_schema(
        tags=TAGS,
        summary="Armed clusters and circuits, and every watched one (armed or active) with its members",
        responses=_ANY,
    )
    def get(self, request) -> Response:
        status_of = _status_of()
        if status_of is not None:
            return envelope(sensing.sensing_list(status_of=status_of))
        return envelope(sensing.sensing_list(status=_status()))

    @extend_schema(
        tags=TAGS,
        summary="Arm a cluster or circuit for sensing: `{kind: cluster|circuit, id}` (id or name)",
        request=OpenApiTypes.OBJECT,
        responses=_ANY,
    )
    def post(self, request) -> Response:
        kind, ref = _ref(request)
        return envelope(sensing.sensing_arm(kind=kind, ref=ref), status_code=201)

    @extend_schema(
        tags=TAGS, summary="Disarm: `{kind, id}` in the body or the query", request=OpenApiTypes.OBJECT, responses=_ANY
    )
    def delete(self, request) -> Response:
        kind, ref = _ref(request)
        return envelope(sensing.sensing_disarm(kind=kind, ref=ref))
