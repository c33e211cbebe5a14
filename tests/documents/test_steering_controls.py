"""Steering controls (a mode, phase, window or condition per feature) outside inline /v1
steering: live steering, profiles, clusters and circuits store them beside their plain
strengths, return them, refuse what inline refuses (nothing changed), keep old documents
exactly as they were, and resolve into the engine's ``SteeringEntry.controls`` — with the
dial λ scaling adds only and the hash covering the controls."""

from __future__ import annotations

import json

import pytest

from gpu_engine.api.protocol import (
    AttachmentStatus,
    FeatureControl,
    PositionRange,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from registry.models import Attachment
from steering.models import Circuit, Cluster, LiveSteering, Profile
from tests.documents.conftest import body, ok, refused

pytestmark = pytest.mark.django_db

CLAMP = {
    "index": 17,
    "mode": "clamp",
    "value": 9.0,
    "phase": "completion",
    "window": {"start": 0, "end": 64},
    "condition": {"feature": 12, "threshold": 1.5},
}
CLAMP_CONTROL = FeatureControl(
    17, mode="clamp", value=9.0, phase="completion", window=PositionRange(0, 64), condition=SteeringCondition(12, 1.5)
)


def _row(sae) -> LiveSteering:
    return LiveSteering.objects.get(attachment__sae_id=sae.id)


def _held(sae, layer: int = 1, d_sae: int = 256) -> list[AttachmentStatus]:
    return [
        AttachmentStatus(
            sae_id=sae.id,
            layer=layer,
            d_sae=d_sae,
            layer_module_path=f"model.layers.{layer}",
            d_in=64,
            activation="relu",
            layout="saelens",
            path="",
        )
    ]


# --------------------------------------------------------------------------- live steering


def test_live_steering_stores_and_returns_controls(api, relu, published, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        state = ok(
            api.post(
                "/api/saes/steering",
                {
                    "feature_idx": 17,
                    "mode": "clamp",
                    "value": 9,
                    "phase": "completion",
                    "window": {"start": 0, "end": 64},
                    "condition": {"feature": 12, "threshold": 1.5},
                },
                format="json",
            )
        )
    assert state["values"] == {} and state["controls"] == [CLAMP]
    assert state["enabled"] is True and state["active_count"] == 1
    row = _row(relu)
    assert (row.values, row.controls, row.enabled) == ({}, [CLAMP], True)
    assert published[-1][1]["controls"] == [CLAMP] and published[-1][1]["active_count"] == 1

    batch = ok(
        api.post(
            "/api/saes/steering/batch",
            {"steering": {"3": 5}, "controls": [{"index": 40, "mode": "ablate"}, {"index": 8, "strength": 2.5}]},
            format="json",
        )
    )
    # a plain add written as a control is a strength, as inline
    assert batch["values"] == {"3": 5.0, "8": 2.5}
    assert batch["controls"] == [CLAMP, {"index": 40, "mode": "ablate"}]
    assert ok(api.get("/api/saes/steering"))["active_count"] == 4
    # setting an index again replaces it, whatever it was
    moved = ok(api.post("/api/saes/steering", {"feature_idx": 40, "value": 1}, format="json"))
    assert moved["values"] == {"3": 5.0, "8": 2.5, "40": 1.0}
    assert moved["controls"] == [CLAMP]
    again = ok(api.post("/api/saes/steering", {"feature_idx": 3, "mode": "scale", "value": 0}, format="json"))
    assert again["values"] == {"8": 2.5, "40": 1.0}
    assert again["controls"] == [{"index": 3, "mode": "scale", "value": 0.0}, CLAMP]

    ok(api.post("/api/saes/steering/disable"))
    assert _row(relu).controls and ok(api.get("/api/saes/steering"))["enabled"] is False
    ok(api.post("/api/saes/steering/enable"))
    removed = ok(api.delete("/api/saes/steering/17"))
    assert removed["controls"] == [{"index": 3, "mode": "scale", "value": 0.0}]
    cleared = ok(api.delete("/api/saes/steering"))
    assert (cleared["values"], cleared["controls"], cleared["enabled"]) == ({}, [], False)
    assert (_row(relu).values, _row(relu).controls) == ({}, [])


@pytest.mark.parametrize(
    ("payload", "status", "code", "param"),
    [
        ({"feature_idx": 1, "mode": "boost", "value": 1}, 422, "VALIDATION_ERROR", "mode"),
        ({"feature_idx": 1, "mode": "add", "value": 1, "phase": "decode"}, 422, "VALIDATION_ERROR", "phase"),
        ({"feature_idx": 1, "mode": "clamp"}, 422, "VALIDATION_ERROR", "value"),
        ({"feature_idx": 1, "mode": "scale"}, 422, "VALIDATION_ERROR", "value"),
        ({"feature_idx": 1, "mode": "ablate", "value": 2}, 422, "VALIDATION_ERROR", "value"),
        ({"feature_idx": 1, "mode": "clamp", "value": 300}, 422, "VALIDATION_ERROR", None),
        ({"feature_idx": 1, "value": 1, "window": {"start": 5, "end": 2}}, 422, "VALIDATION_ERROR", "window"),
        (
            {"feature_idx": 1, "mode": "clamp", "value": 1, "condition": {"feature": 256}},
            400,
            "INVALID_FEATURE_INDEX",
            "condition.feature",
        ),
        ({"feature_idx": 256, "mode": "ablate"}, 400, "INVALID_FEATURE_INDEX", "feature_idx"),
    ],
)
def test_live_refusals_name_the_field_and_change_nothing(api, relu, payload, status, code, param):
    ok(api.post("/api/saes/steering", {"feature_idx": 2, "value": 3}, format="json"))
    error = refused(api.post("/api/saes/steering", payload, format="json"), status, code)
    if param is not None:
        assert error["details"]["param"] == param, error
    assert (_row(relu).values, _row(relu).controls) == ({"2": 3.0}, [])


def test_live_batch_is_all_or_nothing(api, relu):
    for bad, status, code in [
        ({"steering": {"1": 2}, "controls": [{"index": 1, "mode": "ablate"}]}, 422, "VALIDATION_ERROR"),
        (
            {"controls": [{"index": 4, "mode": "ablate"}, {"index": 4, "mode": "clamp", "value": 1}]},
            422,
            "VALIDATION_ERROR",
        ),
        ({"steering": {"1": 2}, "controls": [{"index": 5, "mode": "clamp"}]}, 422, "VALIDATION_ERROR"),
        (
            {
                "steering": {"1": 2},
                "controls": [{"index": 5, "mode": "clamp", "value": 1, "condition": {"feature": 999}}],
            },
            400,
            "INVALID_FEATURE_INDEX",
        ),
    ]:
        error = refused(api.post("/api/saes/steering/batch", bad, format="json"), status, code)
        assert error["details"]["param"], error
    assert not LiveSteering.objects.filter(attachment__sae_id=relu.id).exclude(values={}).exists()
    error = refused(
        api.post(
            "/api/saes/steering/batch",
            {"controls": [{"index": 1, "mode": "add", "value": 1}, {"index": 2, "mode": "nope"}]},
            format="json",
        ),
        422,
        "VALIDATION_ERROR",
    )
    assert error["details"]["param"] == "controls[1].mode"


def test_live_controls_resolve_into_the_spec_and_the_hash(api, relu):
    from steering.live import live_copy
    from steering.services import steering_resolve_request

    ok(
        api.post(
            "/api/saes/steering/batch",
            {"steering": {"3": 5}, "controls": [CLAMP, {"index": 40, "mode": "add", "value": 4, "phase": "prompt"}]},
            format="json",
        )
    )
    resolved = steering_resolve_request(attachments=_held(relu))
    add40 = FeatureControl(40, mode="add", value=4.0, phase="prompt")
    assert resolved.spec == SteeringSpec([SteeringEntry(relu.id, 1, {3: 5.0}, [CLAMP_CONTROL, add40])])
    inline = steering_resolve_request(attachments=_held(relu), inline_features=[(3, 5.0), CLAMP_CONTROL, add40])
    assert resolved.hash == inline.hash and resolved.hash is not None
    assert resolved.header == f"live;sae={relu.id};layer=1;features=3;controls=2"
    # this process's copy carries the controls too (what /v1 uses without a read)
    assert live_copy.fresh() is not None and live_copy.fresh()[0].controls == [CLAMP_CONTROL, add40]
    # the dial scales adds, leaves the clamp as written; 0 is off
    dialled = steering_resolve_request(attachments=_held(relu), intensity=0.5)
    assert dialled.spec == SteeringSpec(
        [
            SteeringEntry(
                relu.id, 1, {3: 2.5}, [CLAMP_CONTROL, FeatureControl(40, mode="add", value=2.0, phase="prompt")]
            )
        ]
    )
    assert not steering_resolve_request(attachments=_held(relu), intensity=0).steered


# --------------------------------------------------------------------------- profiles


def test_profiles_store_export_import_and_activate_controls(api, relu):
    created = ok(
        api.post(
            "/api/profiles",
            {
                "name": "gated",
                "steering": {"3": 10},
                "controls": [CLAMP, {"index": 5, "mode": "ablate"}],
                "intensity": 0.5,
            },
            format="json",
        ),
        201,
    )
    assert created["controls"] == [{"index": 5, "mode": "ablate"}, CLAMP]
    row = Profile.objects.get(name="gated")
    assert (row.steering, row.controls) == ({"3": 10.0}, [{"index": 5, "mode": "ablate"}, CLAMP])
    exported = api.get(f"/api/profiles/{row.id}/export").json()
    assert exported["controls"] == row.controls
    assert list(exported) == [
        "version",
        "name",
        "description",
        "model_id",
        "sae_id",
        "layer",
        "steering",
        "controls",
        "intensity",
        "created_at",
        "updated_at",
    ]
    # export → import → export: the same document
    Profile.objects.filter(pk=row.pk).delete()
    ok(api.post("/api/profiles/import", json.dumps(exported), content_type="application/json"), 201)
    again = Profile.objects.get(name="gated")
    assert api.get(f"/api/profiles/{again.id}/export").json() == exported

    ok(api.post(f"/api/profiles/{again.id}/activate"))
    live = _row(relu)
    assert live.values == {"3": 5.0}  # × λ
    assert live.controls == [{"index": 5, "mode": "ablate"}, CLAMP]  # as written
    # save-current takes the controls along
    saved = ok(api.post("/api/profiles/save-current", {"name": "copy"}, format="json"), 201)
    assert (saved["steering"], saved["controls"]) == ({"3": 5.0}, live.controls)
    # update replaces the list when given
    updated = ok(api.patch(f"/api/profiles/{again.id}", {"controls": []}, format="json"))
    assert updated["controls"] == [] and updated["steering"] == {"3": 10.0}
    # the features form of import takes controls too
    imported = ok(
        api.post(
            "/api/profiles/import",
            json.dumps(
                {
                    "name": "features-form",
                    "sae_id": relu.id,
                    "layer": 1,
                    "features": [{"index": 1, "strength": 2}, {"index": 2, "mode": "clamp", "value": 3}],
                }
            ),
            content_type="application/json",
        ),
        201,
    )
    assert (imported["steering"], imported["controls"]) == ({"1": 2.0}, [{"index": 2, "mode": "clamp", "value": 3.0}])


def test_a_profile_without_controls_exports_as_before(api, relu):
    old = {
        "version": "1.0",
        "name": "ocean",
        "description": "",
        "model_id": None,
        "sae_id": relu.id,
        "layer": 1,
        "steering": {"0": 10.0, "7": -2.5},
        "intensity": 1.0,
        "created_at": "2025-01-02T03:04:05Z",
        "updated_at": "2025-01-02T03:04:06Z",
    }
    text = json.dumps(old, indent=2)
    profile = ok(api.post("/api/profiles/import", text, content_type="application/json"), 201)
    assert Profile.objects.get(name="ocean").controls == []
    assert api.get(f"/api/profiles/{profile['id']}/export").content.decode() == text


@pytest.mark.parametrize(
    ("controls", "status", "code", "param"),
    [
        ([{"index": 1, "mode": "clamp"}], 422, "VALIDATION_ERROR", "controls[0].value"),
        ([{"index": 1, "mode": "ablate", "value": 1}], 422, "VALIDATION_ERROR", "controls[0].value"),
        ([{"index": 1, "mode": "zero"}], 422, "VALIDATION_ERROR", "controls[0].mode"),
        ([{"index": 1, "mode": "add", "value": 1, "phase": "later"}], 422, "VALIDATION_ERROR", "controls[0].phase"),
        ([{"index": 3, "mode": "ablate"}], 422, "VALIDATION_ERROR", "controls"),  # 3 twice
        ({"index": 1}, 422, "VALIDATION_ERROR", "controls"),
    ],
)
def test_profile_refusals_create_nothing(api, relu, controls, status, code, param):
    error = refused(
        api.post("/api/profiles", {"name": "bad", "steering": {"3": 1}, "controls": controls}, format="json"),
        status,
        code,
    )
    assert error["details"]["param"] == param
    assert not Profile.objects.exists()


def test_profile_activation_checks_triggers_and_the_v1_profile_runs_controls(api, relu):
    far = [{"index": 1, "mode": "clamp", "value": 1, "condition": {"feature": 300}}]
    error = refused(
        api.post("/api/profiles", {"name": "far", "controls": far}, format="json"), 400, "INVALID_FEATURE_INDEX"
    )
    assert error["details"]["param"] == "steering.condition.feature"
    # a row written around the services (or bound to an SAE registered later) is
    # refused when it activates
    Profile.objects.create(name="far", sae_id=relu.id, layer=1, steering={}, controls=far)
    error = refused(api.post("/api/profiles/far/activate"), 400, "INVALID_FEATURE_INDEX")
    assert error["details"]["param"] == "steering.condition.feature"
    assert not LiveSteering.objects.exists() and not Profile.objects.get().is_active

    from steering.services import steering_resolve_request

    ok(
        api.post(
            "/api/profiles",
            {"name": "near", "steering": {"3": 4}, "controls": [CLAMP], "intensity": 0.5},
            format="json",
        ),
        201,
    )
    resolved = steering_resolve_request(attachments=_held(relu), profile="near")
    assert resolved.spec == SteeringSpec([SteeringEntry(relu.id, 1, {3: 2.0}, [CLAMP_CONTROL])])
    assert resolved.header == "profile;name=near;intensity=0.5;controls=1"


# --------------------------------------------------------------------------- clusters


def _cluster(members, name="gated"):
    return {
        "kind": "mistudio.cluster-definition",
        "schema_version": "1",
        "name": name,
        "members": members,
        "sae": {"n_features": 256, "layer": 1},
    }


def test_cluster_members_with_modes_import_activate_and_export(api, relu):
    doc = _cluster(
        [
            {"feature_idx": 1, "strength": 150, "sign": -1, "label": "a"},
            {
                "feature_idx": 17,
                "mode": "clamp",
                "value": 9,
                "phase": "completion",
                "window": {"start": 0, "end": 64},
                "condition": {"feature": 12, "threshold": 1.5},
                "label": "b",
            },
            {"feature_idx": 2, "strength": 30, "sign": -1, "phase": "prompt"},
        ]
    )
    text = json.dumps(doc, indent=1)
    out = ok(api.post("/api/clusters/import", text, content_type="application/json"), 201)
    cluster = Cluster.objects.get(pk=out["cluster"]["id"])
    assert cluster.members[1] == {
        "feature_idx": 17,
        "strength": None,
        "sign": 1,
        "label": "b",
        "mode": "clamp",
        "value": 9.0,
        "phase": "completion",
        "window": {"start": 0, "end": 64},
        "condition": {"feature": 12, "threshold": 1.5},
    }
    assert cluster.members[0] == {"feature_idx": 1, "strength": 150.0, "sign": -1, "label": "a"}  # as before
    assert api.get(f"/api/clusters/{cluster.id}/export").content.decode() == text

    ok(api.post(f"/api/clusters/{cluster.id}/activate", {"intensity": 1.5}, format="json"))
    live = _row(relu)
    assert live.values == {"1": -200.0}
    assert live.controls == [{"index": 2, "mode": "add", "value": -45.0, "phase": "prompt"}, CLAMP]
    # named as a /v1 profile, at the cluster's λ
    from steering.services import steering_resolve_request

    resolved = steering_resolve_request(attachments=_held(relu), profile="gated")
    assert resolved.spec == SteeringSpec(
        [SteeringEntry(relu.id, 1, {1: -200.0}, [FeatureControl(2, value=-45.0, phase="prompt"), CLAMP_CONTROL])]
    )


def test_cluster_refusals_and_unbound_triggers(api, relu):
    bad = _cluster([{"feature_idx": 1, "mode": "clamp", "label": "no value"}])
    error = refused(
        api.post("/api/clusters/import", json.dumps(bad), content_type="application/json"), 422, "VALIDATION_ERROR"
    )
    assert "clamp needs a value" in error["details"]["fields"]["members.0"][0], error
    bad = _cluster([{"feature_idx": 1, "strength": 2, "phase": "sometimes"}])
    error = refused(
        api.post("/api/clusters/import", json.dumps(bad), content_type="application/json"), 422, "VALIDATION_ERROR"
    )
    assert "members.0.phase" in error["details"]["fields"], error
    assert not Cluster.objects.exists()
    # a trigger outside the SAE: imported unbound, and activation refuses it
    far = _cluster([{"feature_idx": 1, "mode": "ablate", "condition": {"feature": 999}}])
    out = ok(api.post("/api/clusters/import", json.dumps(far), content_type="application/json"), 201)
    assert out["results"][0]["status"] == "imported_unbound"
    refused(api.post(f"/api/clusters/{out['cluster']['id']}/activate"), 400, "INVALID_FEATURE_INDEX")
    assert not LiveSteering.objects.exists()


# --------------------------------------------------------------------------- circuits


def _circuit(saes, members, name="gated"):
    return {
        "kind": "mistudio.circuit-definition",
        "schema_version": "1",
        "name": name,
        "saes": [{"mistudio_sae_id": saes["tiny-llama-L1-relu"].id, "layer": 1, "n_features": 256}],
        "members": members,
        "edges": [{"up": {"layer": 1, "feature_idx": 10}, "down": {"layer": 1, "feature_idx": 17}, "rung": 2}],
    }


def test_circuit_members_with_modes_activate_compose_and_collide(api, llama):
    saes = {"tiny-llama-L1-relu": llama.sae("tiny-llama-L1-relu")}
    sae = saes["tiny-llama-L1-relu"]
    doc = _circuit(
        saes,
        [
            {"layer": 1, "feature": {"feature_idx": 10, "strength": 40}},
            {
                "layer": 1,
                "feature": {
                    "feature_idx": 17,
                    "mode": "clamp",
                    "value": 9,
                    "phase": "completion",
                    "window": {"start": 0, "end": 64},
                    "condition": {"feature": 12, "threshold": 1.5},
                },
            },
        ],
    )
    text = json.dumps(doc)
    first = ok(api.post("/api/circuits/import", text, content_type="application/json"), 201)
    assert api.get(f"/api/circuits/{first['id']}/export").content.decode() == text
    ok(api.post(f"/api/circuits/{first['id']}/activate", {"intensity": 0.5}, format="json"))
    live = LiveSteering.objects.get(attachment__sae_id=sae.id, attachment__layer=1)
    assert (live.values, live.controls) == ({"10": 20.0}, [CLAMP])
    claims = ok(api.get("/api/circuits/claims"))
    claims = claims["claims"] if isinstance(claims, dict) else claims
    assert claims[0]["steering_keys"] == [10, 17]

    # the same (layer, feature) controlled by another circuit: a collision, never overridable
    clash = _circuit(saes, [{"layer": 1, "feature": {"feature_idx": 17, "mode": "ablate"}}], name="clash")
    other = ok(api.post("/api/circuits/import", json.dumps(clash), content_type="application/json"), 201)
    response = api.post(f"/api/circuits/{other['id']}/activate?allow_layer_overlap=true")
    error = body(response)["error"]
    assert error["code"] == "CIRCUIT_LAYER_CONTENTION"
    assert error["details"]["overridable"] is False
    # other features compose: the union, controls included
    beside = _circuit(saes, [{"layer": 1, "feature": {"feature_idx": 40, "mode": "ablate"}}], name="beside")
    third = ok(api.post("/api/circuits/import", json.dumps(beside), content_type="application/json"), 201)
    ok(api.post(f"/api/circuits/{third['id']}/activate?allow_layer_overlap=true"))
    live.refresh_from_db()
    assert live.controls == [CLAMP, {"index": 40, "mode": "ablate"}]
    ok(api.post(f"/api/circuits/{first['id']}/deactivate"))
    live.refresh_from_db()
    assert (live.values, live.controls) == ({}, [{"index": 40, "mode": "ablate"}])
    assert Circuit.objects.filter(is_active=True).count() == 1
    assert Attachment.objects.count() == 1
