"""Labels wherever a feature appears (issue 34): monitoring history records and statistics
carry ``label`` on a labelled feature and none on an unlabelled one (another SAE's label of
the same index is not this SAE's), profile, cluster and circuit detail answers a ``labels``
map; each answer reads its labels in one query, however many features it lists."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from monitoring.models import ActivationRecord
from registry import labels, services
from registry.models import FeatureExplanation
from steering.models import Circuit, Cluster
from steering.services import profile_create
from tests.envelope import ok

pytestmark = pytest.mark.django_db


@pytest.fixture
def saes(tiny_assets):
    return [
        services.sae_register_local(local_path=str(tiny_assets.saes[name].path), name=name)
        for name in ("tiny-llama-L1-relu", "tiny-llama-L3-relu")
    ]


def explain(sae, index: int, text: str, **kw) -> None:
    FeatureExplanation.objects.create(sae=sae, index=index, description=text, source="user", **kw)


def record(sae, pairs: list[tuple[int, float]], top: list[tuple[int, float]], position: int = 0) -> None:
    ActivationRecord.objects.create(
        timestamp=timezone.now(),
        request_id="chatcmpl-labels",
        sae_id=sae.id,
        layer=1,
        token_position=position,
        activations=[{"feature_index": i, "activation": a} for i, a in pairs],
        top_k=[{"feature_index": i, "activation": a} for i, a in top],
    )


def test_monitoring_history_and_statistics_carry_labels(saes):
    l1, l3 = saes
    explain(l1, 3, "ocean words")
    explain(l1, 3, "the sea, better", score=0.9)
    explain(l3, 4, "a label of the other SAE")
    for position in range(5):
        record(l1, [(3, 1.5), (4, 0.0)], [(3, 1.5), (9, 0.5)], position)
    api = APIClient()
    labels.labels_for(l1.id)  # the labels files (none here) are read once, before counting
    labels.labels_for(l3.id)
    with CaptureQueriesContext(connection) as queries:
        history = ok(api.get("/api/monitoring/history?limit=50"))
    explanation_reads = [q for q in queries.captured_queries if "registry_featureexplanation" in q["sql"]]
    assert len(explanation_reads) == 1  # five records, three features: one query
    assert len(history["records"]) == 5
    for rec in history["records"]:
        assert rec["activations"] == [
            {"feature_index": 3, "activation": 1.5, "label": "the sea, better"},
            {"feature_index": 4, "activation": 0.0},  # l3's feature 4 is labelled, l1's is not
        ]
        assert rec["top_k"] == [
            {"feature_index": 3, "activation": 1.5, "label": "the sea, better"},
            {"feature_index": 9, "activation": 0.5},
        ]
    stats = ok(api.get("/api/monitoring/statistics?features=3,4"))
    by_index = {row["feature_idx"]: row for row in stats["features"]}
    assert by_index[3]["label"] == "the sea, better" and "label" not in by_index[4]
    top = ok(api.post("/api/monitoring/statistics/top", {"k": 2, "metric": "max"}, format="json"))
    assert [(r["feature_idx"], r.get("label")) for r in top["features"]] == [(3, "the sea, better"), (4, None)]


def test_statistics_over_records_of_two_saes_carry_no_label(saes):
    l1, l3 = saes
    explain(l1, 3, "l1's feature 3")
    explain(l3, 3, "l3's feature 3")
    record(l1, [(3, 1.0)], [])
    record(l3, [(3, 2.0)], [])
    stats = ok(APIClient().get("/api/monitoring/statistics?features=3"))
    assert "label" not in stats["features"][0]  # index 3 names a different feature in each
    history = ok(APIClient().get("/api/monitoring/history"))
    assert sorted(r["activations"][0]["label"] for r in history["records"]) == ["l1's feature 3", "l3's feature 3"]


def test_profile_cluster_and_circuit_details_list_labels(saes):
    l1, l3 = saes
    explain(l1, 3, "ocean")
    explain(l1, 40, "formal")
    explain(l3, 3, "not this SAE's")
    api = APIClient()
    profile = profile_create(name="labelled", sae_id=l1.id, layer=1, steering={"3": 2.0, "7": -1.0, "40": 1.0})
    detail = ok(api.get(f"/api/profiles/{profile.pk}"))
    assert detail["labels"] == {"3": "ocean", "40": "formal"}
    cluster = Cluster.objects.create(
        name="c",
        document="{}",
        sae_id=l1.id,
        layer=1,
        members=[{"feature_idx": 3, "strength": 1.0, "label": "authored"}, {"feature_idx": 7, "strength": 1.0}],
    )
    assert ok(api.get(f"/api/clusters/{cluster.pk}"))["labels"] == {"3": "ocean"}
    unbound = Cluster.objects.create(name="u", document="{}", members=[{"feature_idx": 3, "strength": 1.0}])
    assert ok(api.get(f"/api/clusters/{unbound.pk}"))["labels"] == {}
    circuit = Circuit.objects.create(
        name="k",
        document="{}",
        members={"1": [{"feature_idx": 3, "strength": 1.0}], "3": [{"feature_idx": 3, "strength": 1.0}]},
        serving={"1": l1.id, "3": l3.id},
        is_active=True,
    )
    assert ok(api.get(f"/api/circuits/{circuit.pk}"))["labels"] == {"1": {"3": "ocean"}, "3": {"3": "not this SAE's"}}
