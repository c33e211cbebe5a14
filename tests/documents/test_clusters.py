"""/api/clusters: importing mistudio.cluster-definition/v1 documents and bundles (with
their limits), binding to a compatible attachment or importing unbound, activation with
the sign rule, λ and the ±200 clamp, the intensity dial, and the lossless export."""

from __future__ import annotations

import json

import pytest

from steering.models import Cluster, LiveSteering, Profile
from tests.documents.conftest import body, ok, refused

pytestmark = pytest.mark.django_db


def definition(name="fear", members=None, **extra) -> dict:
    doc = {
        "kind": "mistudio.cluster-definition",
        "schema_version": "1",
        "name": name,
        "narrative": "what it means",
        "members": members
        or [
            {"feature_idx": 1, "strength": 150, "sign": -1, "label": "a", "meta": {"future": [1, 2]}},
            {"feature_idx": 2, "strength": -30, "sign": -1},
            {"feature_idx": 3, "strength": 120},
        ],
        "model": {"hf_id": "tiny-llama"},
        "sae": {"n_features": 256, "layer": 1, "source_hint": "hf:acme/saes/L1"},
        "budget": {"intensity": 1.0, "intensity_range": [0.5, 1.5], "B": 3.0},
        "provenance": {"mistudio_version": "9.9"},
        "x_newer_field": {"kept": True},
    }
    doc.update(extra)
    return doc


def _import(api, doc, query="", status=201):
    text = json.dumps(doc, indent=1)
    return ok(api.post(f"/api/clusters/import{query}", text, content_type="application/json"), status), text


def _live(sae):
    row = LiveSteering.objects.filter(attachment__sae_id=sae.id).first()
    return (row.enabled, row.values) if row else None


def test_import_bound_activate_with_sign_rule_and_clamp(api, relu):
    out, text = _import(api, definition())
    assert out["imported"] == 1 and out["results"][0]["status"] == "imported"
    cluster = out["cluster"]
    assert (cluster["bound"], cluster["sae_id"], cluster["layer"]) == (True, relu.id, 1)
    assert cluster["members"][0] == [1, "a", 150.0]
    row = Cluster.objects.get(name="fear")
    assert row.document == text and row.n_features == 256 and row.intensity_range == [0.5, 1.5]

    active = ok(api.post(f"/api/clusters/{row.id}/activate", {"intensity": 1.5}, format="json"))
    assert active["is_active"] is True and active["intensity"] == 1.5
    # member 1: 150 with sign -1 → -150 × 1.5 = -225 → clamped to -200
    # member 2: -30 is already directional (sign ignored) → -45
    # member 3: +120 × 1.5 = 180
    assert _live(relu) == (True, {"1": -200.0, "2": -45.0, "3": 180.0})
    assert ok(api.get("/api/clusters/active"))["id"] == row.id
    assert ok(api.get("/api/health/detailed"))["active_profile"] == {
        "id": row.id,
        "name": "fear",
        "source_kind": "cluster",
        "intensity": 1.5,
    }

    # the dial re-applies at once; outside the declared range is refused (0 always allowed)
    dialled = ok(api.put("/api/clusters/active/intensity", {"intensity": 0.5}, format="json"))
    assert dialled["reapplied"] is True and dialled["intensity"] == 0.5
    assert _live(relu) == (True, {"1": -75.0, "2": -15.0, "3": 60.0})
    refused(api.put(f"/api/clusters/{row.id}/intensity", {"intensity": 1.8}, format="json"), 422, "VALIDATION_ERROR")
    assert _live(relu) == (True, {"1": -75.0, "2": -15.0, "3": 60.0})
    ok(api.put(f"/api/clusters/{row.id}/intensity", {"intensity": 0}, format="json"))
    assert _live(relu) == (True, {"1": 0.0, "2": 0.0, "3": 0.0})

    # the export is the imported document, byte for byte (λ changes are not written in)
    exported = api.get(f"/api/clusters/{row.id}/export")
    assert exported.status_code == 200 and exported.content.decode() == text

    ok(api.post(f"/api/clusters/{row.id}/deactivate"))
    assert _live(relu) is None and not Cluster.objects.get(pk=row.id).is_active
    response = api.put("/api/clusters/active/intensity", {"intensity": 1}, format="json")
    assert response.status_code == 200 and body(response)["error"]["code"] == "NO_ACTIVE_CLUSTER"


def test_unbound_imports_are_refused_at_activation_with_the_reason(api, llama):
    out, _ = _import(api, definition("nothing-attached"))
    assert out["results"][0]["status"] == "imported_unbound"
    assert "No SAE is attached" in out["cluster"]["unbound_reason"]
    wide, _ = _import(api, definition("wide", sae={"n_features": 16384, "layer": 1}))
    far, _ = _import(api, definition("far", members=[{"feature_idx": 300, "strength": 2}], sae={"layer": 1}))
    relu = llama.attach("tiny-llama-L1-relu", 1)
    ok(api.post("/api/saes/steering", {"feature_idx": 9, "value": 4}, format="json"))

    error = refused(api.post(f"/api/clusters/{wide['cluster']['id']}/activate"), 422, "INCOMPATIBLE_FEATURE_SPACE")
    assert "16384" in error["message"] and "256" in error["message"]
    refused(api.post(f"/api/clusters/{far['cluster']['id']}/activate"), 400, "INVALID_FEATURE_INDEX")
    assert _live(relu) == (True, {"9": 4.0})  # nothing changed

    # the unbound one binds the first time it activates against a compatible SAE
    bound = ok(api.post(f"/api/clusters/{out['cluster']['id']}/activate"))
    assert (bound["bound"], bound["sae_id"], bound["unbound_reason"]) == (True, relu.id, None)
    assert _live(relu)[1] == {"1": -150.0, "2": -30.0, "3": 120.0}


def test_bundles_import_item_by_item(api, relu):
    bundle = {
        "kind": "mistudio.cluster-bundle",
        "schema_version": "1",
        "definitions": [
            definition("one"),
            definition("two", members=[{"feature_idx": -1, "strength": 1}]),
            definition("one"),
        ],
    }
    out, _ = _import(api, bundle)
    assert [r["status"] for r in out["results"]] == ["imported", "failed", "imported"]
    assert out["results"][1]["error"]["code"] == "VALIDATION_ERROR"
    assert out["results"][2]["cluster"]["name"] == "one (2)"  # on_conflict=rename
    assert set(Cluster.objects.values_list("name", flat=True)) == {"one", "one (2)"}
    # a definition inside a bundle exports as itself, every field kept
    exported = json.loads(api.get(f"/api/clusters/{out['results'][0]['cluster']['id']}/export").content)
    assert exported == definition("one")
    refused(
        api.post("/api/clusters/import?on_conflict=fail", definition("one"), format="json"),
        409,
        "CLUSTER_ALREADY_EXISTS",
    )


def test_limits_and_refusals(api, relu):
    members = [{"feature_idx": i, "strength": 1} for i in range(21)]
    error = refused(
        api.post("/api/clusters/import", definition("big", members=members), format="json"), 422, "VALIDATION_ERROR"
    )
    assert "members" in json.dumps(error["details"])
    ok(api.post("/api/clusters/import", definition("twenty", members=members[:20]), format="json"), 201)
    too_many = {"kind": "mistudio.cluster-bundle", "definitions": [definition(f"d{i}") for i in range(51)]}
    refused(api.post("/api/clusters/import", too_many, format="json"), 422, "VALIDATION_ERROR")
    refused(
        api.post("/api/clusters/import", definition("s", members=[{"feature_idx": 1, "strength": 301}]), format="json"),
        422,
        "VALIDATION_ERROR",
    )
    refused(
        api.post("/api/clusters/import", definition("path", sae={"source_hint": "/etc/saes/x"}), format="json"),
        422,
        "VALIDATION_ERROR",
    )
    huge = definition("huge", narrative="x" * 9000)
    huge["padding"] = "y" * 1_000_001
    for doc, code in (
        (huge, "PAYLOAD_TOO_LARGE"),
        ({"kind": "mistudio.probe-definition", "name": "p"}, "UNKNOWN_KIND"),
    ):
        response = api.post("/api/clusters/import", doc, format="json")
        assert response.status_code == 200 and body(response)["error"]["code"] == code
    assert set(Cluster.objects.values_list("name", flat=True)) == {"twenty"}


def test_one_active_configuration_and_per_request_names(api, relu):
    out, _ = _import(api, definition())
    profile = ok(api.post("/api/profiles", {"name": "p", "steering": {"7": 3}}, format="json"), 201)
    ok(api.post(f"/api/profiles/{profile['id']}/activate"))
    ok(api.post(f"/api/clusters/{out['cluster']['id']}/activate"))
    assert not Profile.objects.filter(is_active=True).exists()
    assert _live(relu)[1] == {"1": -150.0, "2": -30.0, "3": 120.0}
    ok(api.post(f"/api/profiles/{profile['id']}/activate"))
    assert not Cluster.objects.filter(is_active=True).exists()
    assert _live(relu)[1] == {"7": 3.0}
    # renaming is fine; the members stay the document's
    renamed = ok(api.patch(f"/api/clusters/{out['cluster']['id']}", {"name": "dread"}, format="json"))
    assert renamed["name"] == "dread" and renamed["member_count"] == 3
    ok(api.delete(f"/api/clusters/{out['cluster']['id']}"))
    refused(api.get(f"/api/clusters/{out['cluster']['id']}"), 404, "CLUSTER_NOT_FOUND")


def test_resolver_uses_a_cluster_named_as_profile(relu):
    from steering.services import cluster_import, steering_resolve_request
    from tests.documents.helpers import engine_attachments

    cluster_import(document=definition())
    resolved = steering_resolve_request(attachments=engine_attachments(), profile="fear", intensity=2.0)
    assert resolved.mode == "profile"
    assert resolved.spec.as_mapping() == {(relu.id, 1): {1: -200.0, 2: -60.0, 3: 200.0}}


@pytest.mark.parametrize("kind", ["clusters", "circuits", "profiles", "models"])
def test_a_unicode_digit_id_is_a_name_not_found_never_a_500(api, kind):
    """ "²" passes ``str.isdigit`` but not ``int``: it is read as a name, and no record has
    it (schemathesis found DELETE /api/clusters/%C2%B2 answering 500)."""
    for call in (api.get, api.delete):
        resp = call(f"/api/{kind}/%C2%B2")
        assert resp.status_code == 404, (call, resp.content)
        assert resp.json()["error"]["code"].endswith("NOT_FOUND"), resp.content
