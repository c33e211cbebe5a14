"""/api/circuits: importing mistudio.circuit-definition/v1 (limits, rung = minimum over the
edges), the evidence gate, serving through attach_set of every member layer, layer claims
(contention, the override, collisions), one λ across layers, deactivation and export."""

from __future__ import annotations

import json

import pytest

from registry.models import Attachment
from steering.models import Circuit, LiveSteering
from tests.documents.conftest import body, ok, refused

pytestmark = pytest.mark.django_db


def circuit(name, saes, members, edges=None, **extra) -> dict:
    doc = {
        "kind": "mistudio.circuit-definition",
        "schema_version": "1",
        "name": name,
        "saes": saes,
        "members": members,
        "edges": edges if edges is not None else [],
        "x_unknown": [1],
    }
    doc.update(extra)
    return doc


def feature(layer, idx, strength, sign=1):
    return {"layer": layer, "feature": {"feature_idx": idx, "strength": strength, "sign": sign}}


def edge(up, down, rung):
    return {
        "up": {"layer": up[0], "feature_idx": up[1]},
        "down": {"layer": down[0], "feature_idx": down[1]},
        "rung": rung,
    }


@pytest.fixture
def saes(llama):
    return {name: llama.sae(name) for name in ("tiny-llama-L1-relu", "tiny-llama-L3-relu", "tiny-llama-L2-topk")}


def two_layer(saes, name="chain", rung=2, **extra):
    return circuit(
        name,
        [
            {"mistudio_sae_id": saes["tiny-llama-L1-relu"].id, "layer": 1, "n_features": 256},
            # an SAE named by its registered name also resolves
            {"sae_id": "tiny-llama-L3-relu", "layer": 3},
        ],
        [
            feature(1, 10, 40),
            feature(1, 11, -25, sign=-1),
            {
                "layer": 3,
                "member_kind": "cluster_ref",
                "cluster_name": "c",
                "expanded_members": [
                    {"feature_idx": 20, "strength": 150, "sign": -1},
                    {"feature_idx": 21, "strength": 5},
                ],
            },
        ],
        [edge((1, 10), (3, 20), rung), edge((1, 11), (3, 21), 3)],
        budget={"intensity": 1.0, "intensity_range": [0.25, 2.0]},
        **extra,
    )


def _import(api, doc):
    text = json.dumps(doc)
    return ok(api.post("/api/circuits/import", text, content_type="application/json"), 201), text


def _live():
    return {
        (r.attachment.sae_id, r.attachment.layer): r.values
        for r in LiveSteering.objects.select_related("attachment").filter(enabled=True)
    }


def test_import_rung_gate_attach_set_and_one_lambda(api, saes, llama, published, django_capture_on_commit_callbacks):
    weak, text = _import(api, two_layer(saes, rung=1))
    assert (weak["rung"], weak["rung_language"]) == (1, "suggested (attribution-supported)")
    assert weak["layers"] == [1, 3] and weak["edge_count"] == 2
    assert Circuit.objects.get(pk=weak["id"]).rung == 1
    assert not Attachment.objects.exists()  # import never activates

    response = api.post(f"/api/circuits/{weak['id']}/activate")
    assert response.status_code == 200
    error = body(response)["error"]
    assert error["code"] == "UNVALIDATED_CIRCUIT" and error["details"]["rung"] == 1
    assert error["details"]["rung_language"] == "suggested (attribution-supported)"
    assert not Attachment.objects.exists() and not LiveSteering.objects.exists()

    with django_capture_on_commit_callbacks(execute=True):
        active = ok(
            api.post(
                f"/api/circuits/{weak['id']}/activate?acknowledge_unvalidated=true", {"intensity": 1.5}, format="json"
            )
        )
    assert active["is_active"] is True and active["serving_mode"] == "full"
    l1, l3 = saes["tiny-llama-L1-relu"].id, saes["tiny-llama-L3-relu"].id
    # every member layer attached through attach_set, in the rows and in the engine
    assert set(Attachment.objects.values_list("sae_id", "layer")) == {(l1, 1), (l3, 3)}
    assert {(a.sae_id, a.layer) for a in llama.engine.attachments()} == {(l1, 1), (l3, 3)}
    # one λ for every layer, sign rule, each value clamped
    assert _live() == {(l1, 1): {"10": 60.0, "11": -37.5}, (l3, 3): {"20": -200.0, "21": 7.5}}
    assert {d["layer"] for n, d in published if n == "steering:update"} == {1, 3}

    dialled = ok(
        api.put("/api/circuits/active/intensity", {"intensity": 0.5, "acknowledge_unvalidated": True}, format="json")
    )
    assert dialled["reapplied"] is True
    assert _live() == {(l1, 1): {"10": 20.0, "11": -12.5}, (l3, 3): {"20": -75.0, "21": 2.5}}
    refused(
        api.put(f"/api/circuits/{weak['id']}/intensity", {"intensity": 0.1}, format="json"), 422, "VALIDATION_ERROR"
    )
    response = api.put(
        f"/api/circuits/{weak['id']}/intensity", {"intensity": 1}, format="json"
    )  # a stronger dial re-passes the gate
    assert body(response)["error"]["code"] == "UNVALIDATED_CIRCUIT"

    assert api.get(f"/api/circuits/{weak['id']}/export").content.decode() == text
    ok(api.post(f"/api/circuits/{weak['id']}/deactivate"))
    assert _live() == {} and ok(api.get("/api/circuits/active"))["total"] == 0
    response = api.put("/api/circuits/active/intensity", {"intensity": 1}, format="json")
    assert body(response)["error"]["code"] == "NO_ACTIVE_CIRCUIT"


def test_detaching_one_member_sae_ends_the_circuit_and_its_claims(api, saes, llama):
    chain, _ = _import(api, two_layer(saes, rung=2))
    ok(api.post(f"/api/circuits/{chain['id']}/activate"))
    l1, l3 = saes["tiny-llama-L1-relu"].id, saes["tiny-llama-L3-relu"].id
    assert set(_live()) == {(l1, 1), (l3, 3)}
    ok(api.post(f"/api/saes/{l1}/detach", {}, format="json"))
    assert ok(api.get("/api/circuits/active"))["total"] == 0
    assert ok(api.get("/api/circuits/claims"))["claims"] == []
    assert _live() == {}  # its values left the layer still attached, too
    assert Attachment.objects.filter(sae_id=l3, layer=3).exists()


def test_layer_claims_contention_override_and_collision(api, saes):
    l1, l2, l3 = (saes[n].id for n in ("tiny-llama-L1-relu", "tiny-llama-L2-topk", "tiny-llama-L3-relu"))
    first, _ = _import(api, two_layer(saes, name="first"))
    ok(api.post(f"/api/circuits/{first['id']}/activate"))
    second, _ = _import(
        api,
        circuit(
            "second",
            [{"mistudio_sae_id": l2, "layer": 2}, {"mistudio_sae_id": l3, "layer": 3}],
            [feature(2, 1, 10), feature(3, 30, 4)],
            [edge((2, 1), (3, 30), 3)],
        ),
    )
    response = api.post(f"/api/circuits/{second['id']}/activate")
    error = body(response)["error"]
    assert response.status_code == 200 and error["code"] == "CIRCUIT_LAYER_CONTENTION"
    assert error["details"]["overridable"] is True
    assert error["details"]["incumbents"] == [{"circuit_id": first["id"], "circuit_name": "first", "layers": [3]}]
    assert not Attachment.objects.filter(layer=2).exists()  # refused before attaching

    composed = ok(api.post(f"/api/circuits/{second['id']}/activate", {"allow_layer_overlap": True}, format="json"))
    assert composed["composed_layers"] == [3] and composed["allowed_layer_overlap"] is True
    assert _live()[(l3, 3)] == {"20": -150.0, "21": 5.0, "30": 4.0}
    assert _live()[(l2, 2)] == {"1": 10.0}
    claims = ok(api.get("/api/circuits/claims"))["claims"]
    assert [(c["layer"], c["circuit_name"], c["composed"]) for c in claims] == [
        (1, "first", False),
        (2, "second", False),
        (3, "first", True),
        (3, "second", True),
    ]
    response = api.put("/api/circuits/active/intensity", {"intensity": 1}, format="json")
    assert body(response)["error"]["code"] == "AMBIGUOUS_ACTIVE_CIRCUIT"

    # the same (layer, feature) twice can never be overridden
    third, _ = _import(
        api, circuit("third", [{"mistudio_sae_id": l1, "layer": 1}], [feature(1, 10, 3)], [edge((1, 10), (1, 10), 2)])
    )
    response = api.post(f"/api/circuits/{third['id']}/activate", {"allow_layer_overlap": True}, format="json")
    error = body(response)["error"]
    assert error["code"] == "CIRCUIT_LAYER_CONTENTION" and error["details"]["overridable"] is False
    assert error["details"]["colliding_keys"] == [{"layer": 1, "feature_idx": 10, "circuit_id": first["id"]}]
    assert "override_param" not in error["details"]

    # deactivating one takes its values off the shared layer and keeps the other's
    ok(api.post(f"/api/circuits/{first['id']}/deactivate"))
    assert _live() == {(l3, 3): {"30": 4.0}, (l2, 2): {"1": 10.0}}
    assert Circuit.objects.get(pk=second["id"]).composed_layers == []


def test_incomplete_sae_sets_and_feature_spaces(api, saes):
    l1 = saes["tiny-llama-L1-relu"].id
    unknown, _ = _import(
        api,
        circuit(
            "unknown",
            [{"mistudio_sae_id": l1, "layer": 1}, {"mistudio_sae_id": "sae_0000000000000000", "layer": 2}],
            [feature(1, 1, 2), feature(2, 5, 2), feature(2, 6, 1)],
            [edge((1, 1), (2, 5), 3)],
        ),
    )
    error = refused(api.post(f"/api/circuits/{unknown['id']}/activate"), 422, "SAE_SET_INCOMPLETE")
    assert error["details"]["offenders"] == [
        {"feature_idx": 5, "layer": 2, "sae_id": "sae_0000000000000000", "reason": "not registered on this server"},
        {"feature_idx": 6, "layer": 2, "sae_id": "sae_0000000000000000", "reason": "not registered on this server"},
    ]
    assert not Attachment.objects.exists()
    wide, _ = _import(
        api,
        circuit(
            "wide",
            [{"mistudio_sae_id": l1, "layer": 1, "n_features": 16384}],
            [feature(1, 1, 2)],
            [edge((1, 1), (1, 1), 2)],
        ),
    )
    refused(api.post(f"/api/circuits/{wide['id']}/activate"), 422, "INCOMPATIBLE_FEATURE_SPACE")
    far, _ = _import(
        api, circuit("far", [{"mistudio_sae_id": l1, "layer": 1}], [feature(1, 999, 2)], [edge((1, 999), (1, 999), 2)])
    )
    refused(api.post(f"/api/circuits/{far['id']}/activate"), 400, "INVALID_FEATURE_INDEX")
    assert not Attachment.objects.exists() and not Circuit.objects.filter(is_active=True)


def test_import_limits(api, saes):
    l1 = saes["tiny-llama-L1-relu"].id
    base = [{"mistudio_sae_id": l1, "layer": 1}]
    many_saes = [{"mistudio_sae_id": f"s{i}", "layer": i} for i in range(17)]
    cases = {
        "17 SAEs": circuit("a", many_saes, [feature(0, 1, 1)]),
        "21 members on a layer": circuit("b", base, [feature(1, i, 1) for i in range(21)]),
        "201 edges": circuit("c", base, [feature(1, 1, 1)], [edge((1, 1), (1, 1), 2)] * 201),
        "rung 4": circuit("d", base, [feature(1, 1, 1)], [edge((1, 1), (1, 1), 4)]),
        "a member layer without an SAE": circuit("e", base, [feature(2, 1, 1)]),
        "a path as the SAE": circuit("f", [{"source_hint": "~/saes/x", "layer": 1}], [feature(1, 1, 1)]),
        "no members": circuit("g", base, []),
    }
    for label, doc in cases.items():
        response = api.post("/api/circuits/import", doc, format="json")
        assert response.status_code == 422, (label, body(response))
        assert body(response)["error"]["code"] == "VALIDATION_ERROR", label
    sixteen = [{"mistudio_sae_id": f"s{i}", "layer": i} for i in range(16)]
    ok(
        api.post(
            "/api/circuits/import",
            circuit("edge-of-limits", sixteen, [feature(0, i, 1) for i in range(20)], [edge((0, 1), (1, 1), 3)] * 200),
            format="json",
        ),
        201,
    )
    no_edges, _ = _import(api, circuit("bare", base, [feature(1, 1, 1)]))
    assert no_edges["rung"] == 0 and no_edges["rung_language"] == "associated"
    response = api.post("/api/circuits/import", {"kind": "mistudio.cluster-definition", "name": "x"}, format="json")
    assert body(response)["error"]["code"] == "UNKNOWN_KIND"
    assert set(Circuit.objects.values_list("name", flat=True)) == {"edge-of-limits", "bare"}


def test_replace_keeps_the_id_and_refuses_what_would_change_nothing_safely(
    api, saes, llama, django_capture_on_commit_callbacks
):
    """PUT /api/circuits/{id} replaces the stored document in place (the page's editor
    saves through it): the same id, the new members and text; a document that does not
    validate, a name another circuit holds, and a serving circuit are refused, unchanged."""
    first, _ = _import(api, two_layer(saes, name="chain", rung=2))
    other, _ = _import(api, two_layer(saes, name="other", rung=2))
    edited = two_layer(saes, name="chain renamed", rung=3)
    edited["members"][0] = feature(1, 12, 30)
    text = json.dumps(edited)
    replaced = ok(api.put(f"/api/circuits/{first['id']}", text, content_type="application/json"))
    assert replaced["id"] == first["id"] and replaced["name"] == "chain renamed"
    assert first["rung"] == 2 and replaced["rung"] == 3  # the minimum over the new edges
    row = Circuit.objects.get(pk=first["id"])
    assert row.members["1"][0]["feature_idx"] == 12 and row.members["1"][0]["strength"] == 30
    assert api.get(f"/api/circuits/{first['id']}/export").content.decode() == text
    assert Circuit.objects.count() == 2

    bad = two_layer(saes, name="chain renamed")
    bad["members"] = []
    refused(api.put(f"/api/circuits/{first['id']}", bad, format="json"), 422, "VALIDATION_ERROR")
    refused(
        api.put(f"/api/circuits/{first['id']}", two_layer(saes, name="other"), format="json"),
        409,
        "CIRCUIT_ALREADY_EXISTS",
    )
    assert api.get(f"/api/circuits/{first['id']}/export").content.decode() == text

    with django_capture_on_commit_callbacks(execute=True):
        ok(api.post(f"/api/circuits/{other['id']}/activate", {"intensity": 1.0}, format="json"))
    refused(
        api.put(f"/api/circuits/{other['id']}", two_layer(saes, name="other", rung=3), format="json"),
        409,
        "CIRCUIT_SERVING",
    )
    ok(api.post(f"/api/circuits/{other['id']}/deactivate"))
