"""/api/clusters and /api/circuits: import, list, activate/deactivate, the intensity
dial, claims and export. The exports answer the stored document itself (no envelope):
the file is the portable artifact."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import body_object, envelope, validated
from core.ids import ascii_int
from core.schema import enveloped
from steering import serializers as io
from steering import services
from steering.apis import raw_document, raw_json
from steering.models import Circuit, Cluster

CLUSTERS, CIRCUITS = ["clusters"], ["circuits"]
_ANY = enveloped(OpenApiTypes.OBJECT)
_IMPORT_PARAMS = [
    OpenApiParameter("on_conflict", str, required=False, enum=["rename", "fail"]),
    OpenApiParameter("activate", bool, required=False),
]


def _merged(request) -> dict:
    return {**request.query_params.dict(), **body_object(request)}


# --------------------------------------------------------------------------- clusters


class ClusterListApi(APIView):
    @extend_schema(tags=CLUSTERS, summary="List clusters", operation_id="clusters_list", responses=_ANY)
    def get(self, request) -> Response:
        rows = [io.cluster_out(c) for c in Cluster.objects.all()]
        return envelope({"clusters": rows, "total": len(rows)})


class ClusterImportApi(APIView):
    @extend_schema(
        tags=CLUSTERS,
        summary="Import a mistudio.cluster-definition/v1 document or "
        "a mistudio.cluster-bundle/v1 (≤ 50 definitions, ≤ 1 MB)",
        parameters=_IMPORT_PARAMS,
        request=OpenApiTypes.OBJECT,
        responses={201: _ANY},
    )
    def post(self, request) -> Response:
        query = validated(io.ImportQuery, request.query_params)
        data, text = raw_document(request)
        out = services.cluster_import(
            document=data, text=text, on_conflict=query.get("on_conflict") or "rename", activate=query["activate"]
        )
        for result in out["results"]:
            if result["cluster"] is not None:
                result["cluster"] = io.cluster_out(result["cluster"])
        if len(out["results"]) == 1 and out["results"][0]["cluster"] is not None:
            out["cluster"] = out["results"][0]["cluster"]
        return envelope(out, status_code=status.HTTP_201_CREATED if out["imported"] else status.HTTP_200_OK)


class ClusterActiveApi(APIView):
    @extend_schema(tags=CLUSTERS, summary="The active cluster (or null)", responses=_ANY)
    def get(self, request) -> Response:
        cluster = services.cluster_active()
        return envelope(io.cluster_out(cluster) if cluster else None)


class ClusterActiveIntensityApi(APIView):
    @extend_schema(
        tags=CLUSTERS,
        summary="Dial the active cluster's λ (NO_ACTIVE_CLUSTER without one)",
        request=io.DialInput,
        responses=_ANY,
    )
    def put(self, request) -> Response:
        data = validated(io.DialInput, body_object(request))
        cluster, reapplied = services.cluster_set_active_intensity(intensity=data["intensity"], reapply=data["reapply"])
        return envelope({**io.cluster_out(cluster), "reapplied": reapplied})


class ClusterDetailApi(APIView):
    @extend_schema(tags=CLUSTERS, summary="One cluster (members in full)", responses=_ANY)
    def get(self, request, cluster_id: str) -> Response:
        return envelope(io.cluster_detail_out(services.cluster_get(cluster_id=cluster_id)))

    @extend_schema(
        tags=CLUSTERS,
        summary="Rename or edit the narrative (members are the document's)",
        request=io.ClusterUpdateInput,
        responses=_ANY,
    )
    def patch(self, request, cluster_id: str) -> Response:
        cluster = services.cluster_get(cluster_id=cluster_id)
        data = validated(io.ClusterUpdateInput, body_object(request))
        return envelope(
            io.cluster_out(
                services.cluster_update(cluster=cluster, name=data.get("name"), narrative=data.get("narrative"))
            )
        )

    @extend_schema(tags=CLUSTERS, summary="Delete (an active cluster is deactivated first)", responses=_ANY)
    def delete(self, request, cluster_id: str) -> Response:
        cluster = services.cluster_get(cluster_id=cluster_id)
        services.cluster_delete(cluster=cluster)
        return envelope({"status": "deleted", "id": cluster.pk})


class ClusterActivateApi(APIView):
    @extend_schema(
        tags=CLUSTERS,
        summary="Activate: every member steers together (replaces "
        "the live steering); refused with the reason when it cannot bind",
        request=io.ActivateInput,
        responses=_ANY,
    )
    def post(self, request, cluster_id: str) -> Response:
        cluster = services.cluster_get(cluster_id=cluster_id)
        data = validated(io.ActivateInput, _merged(request))
        cluster = services.cluster_activate(
            cluster=cluster, intensity=data.get("intensity"), sae_id=data.get("sae_id"), layer=data.get("layer")
        )
        return envelope(io.cluster_out(cluster))


class ClusterDeactivateApi(APIView):
    @extend_schema(tags=CLUSTERS, summary="Deactivate (clears the live steering)", request=None, responses=_ANY)
    def post(self, request, cluster_id: str) -> Response:
        cluster = services.cluster_deactivate(cluster=services.cluster_get(cluster_id=cluster_id))
        return envelope(io.cluster_out(cluster))


class ClusterIntensityApi(APIView):
    @extend_schema(
        tags=CLUSTERS, summary="Set λ (an active cluster re-applies at once)", request=io.DialInput, responses=_ANY
    )
    def put(self, request, cluster_id: str) -> Response:
        cluster = services.cluster_get(cluster_id=cluster_id)
        data = validated(io.DialInput, body_object(request))
        cluster, reapplied = services.cluster_set_intensity(
            cluster=cluster, intensity=data["intensity"], reapply=data["reapply"]
        )
        return envelope({**io.cluster_out(cluster), "reapplied": reapplied})


class ClusterExportApi(APIView):
    @extend_schema(
        tags=CLUSTERS,
        summary="The definition exactly as imported (no envelope)",
        responses={(200, "application/json"): OpenApiTypes.OBJECT},
    )
    def get(self, request, cluster_id: str):
        cluster = services.cluster_get(cluster_id=cluster_id)
        return raw_json(cluster.document, f"{cluster.name}.cluster.json")


# --------------------------------------------------------------------------- circuits


class CircuitListApi(APIView):
    @extend_schema(
        tags=CIRCUITS,
        summary="List circuits (with rung and rung_language)",
        operation_id="circuits_documents_list",
        parameters=[OpenApiParameter("min_rung", int, required=False)],
        responses=_ANY,
    )
    def get(self, request) -> Response:
        qs = Circuit.objects.all()
        min_rung = request.query_params.get("min_rung")
        if (rung := ascii_int(min_rung)) is not None:
            qs = qs.filter(rung__gte=rung)
        rows = [io.circuit_out(c) for c in qs]
        return envelope({"circuits": rows, "total": len(rows)})


class CircuitImportApi(APIView):
    @extend_schema(
        tags=CIRCUITS,
        summary="Import a mistudio.circuit-definition/v1 document (never activates)",
        parameters=_IMPORT_PARAMS[:1],
        request=OpenApiTypes.OBJECT,
        responses={201: _ANY},
    )
    def post(self, request) -> Response:
        query = validated(io.ImportQuery, request.query_params)
        data, text = raw_document(request)
        circuit = services.circuit_import(document=data, text=text, on_conflict=query.get("on_conflict") or "rename")
        return envelope(io.circuit_out(circuit, full=True), status_code=status.HTTP_201_CREATED)


class CircuitActiveApi(APIView):
    @extend_schema(
        tags=CIRCUITS,
        summary="The serving circuits (a list; ?single=true: one or null)",
        parameters=[OpenApiParameter("single", bool, required=False)],
        responses=_ANY,
    )
    def get(self, request) -> Response:
        active = [io.circuit_out(c) for c in services.circuits_active()]
        if str(request.query_params.get("single", "")).lower() == "true":
            return envelope(active[0] if active else None)
        return envelope({"circuits": active, "total": len(active)})


class CircuitActiveIntensityApi(APIView):
    @extend_schema(tags=CIRCUITS, summary="Dial the one serving circuit's λ", request=io.DialInput, responses=_ANY)
    def put(self, request) -> Response:
        data = validated(io.DialInput, body_object(request))
        circuit, reapplied = services.circuit_set_active_intensity(
            intensity=data["intensity"],
            reapply=data["reapply"],
            acknowledge_unvalidated=data["acknowledge_unvalidated"],
        )
        return envelope({**io.circuit_out(circuit), "reapplied": reapplied, "superseded": False})


class CircuitClaimsApi(APIView):
    @extend_schema(tags=CIRCUITS, summary="Who holds which layer", responses=_ANY)
    def get(self, request) -> Response:
        claims = services.circuit_claims()
        return envelope({"claims": claims, "total": len(claims)})


class CircuitDetailApi(APIView):
    @extend_schema(tags=CIRCUITS, summary="One circuit (members by layer)", responses=_ANY)
    def get(self, request, circuit_id: str) -> Response:
        return envelope(io.circuit_detail_out(services.circuit_get(circuit_id=circuit_id)))

    @extend_schema(
        tags=CIRCUITS,
        summary="Replace the circuit's document, keeping its id (a serving circuit: 409 CIRCUIT_SERVING)",
        request=OpenApiTypes.OBJECT,
        responses=_ANY,
    )
    def put(self, request, circuit_id: str) -> Response:
        circuit = services.circuit_get(circuit_id=circuit_id)
        data, text = raw_document(request)
        return envelope(io.circuit_out(services.circuit_replace(circuit=circuit, document=data, text=text), full=True))

    @extend_schema(tags=CIRCUITS, summary="Delete (a serving circuit is deactivated first)", responses=_ANY)
    def delete(self, request, circuit_id: str) -> Response:
        circuit = services.circuit_get(circuit_id=circuit_id)
        services.circuit_delete(circuit=circuit)
        return envelope({"status": "deleted", "id": circuit.pk})


class CircuitDeactivateApi(APIView):
    @extend_schema(tags=CIRCUITS, summary="Deactivate (releases its layers)", request=None, responses=_ANY)
    def post(self, request, circuit_id: str) -> Response:
        circuit = services.circuit_deactivate(circuit=services.circuit_get(circuit_id=circuit_id))
        return envelope(io.circuit_out(circuit))


class CircuitIntensityApi(APIView):
    @extend_schema(
        tags=CIRCUITS,
        summary="Set λ for every layer (a serving circuit re-applies and re-passes the evidence gate)",
        request=io.DialInput,
        responses=_ANY,
    )
    def put(self, request, circuit_id: str) -> Response:
        circuit = services.circuit_get(circuit_id=circuit_id)
        data = validated(io.DialInput, body_object(request))
        circuit, reapplied = services.circuit_set_intensity(
            circuit=circuit,
            intensity=data["intensity"],
            reapply=data["reapply"],
            acknowledge_unvalidated=data["acknowledge_unvalidated"],
        )
        return envelope({**io.circuit_out(circuit), "reapplied": reapplied, "superseded": False})


class CircuitExportApi(APIView):
    @extend_schema(
        tags=CIRCUITS,
        summary="The definition exactly as imported (no envelope)",
        responses={(200, "application/json"): OpenApiTypes.OBJECT},
    )
    def get(self, request, circuit_id: str):
        circuit = services.circuit_get(circuit_id=circuit_id)
        return raw_json(circuit.document, f"{circuit.name}.circuit.json")
