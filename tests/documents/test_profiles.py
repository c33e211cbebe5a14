"""/api/profiles: CRUD with unique names, save-current, activate (replacing the live
steering, validated before anything changes, λ-scaled and clamped), deactivate, and the
versioned export that round-trips through import."""

from __future__ import annotations

import json

import pytest

from steering.models import LiveSteering, Profile
from tests.documents.conftest import body, ok, refused

pytestmark = pytest.mark.django_db


def _live(sae, layer):
    row = LiveSteering.objects.filter(attachment__sae_id=sae.id, attachment__layer=layer).first()
    return (row.enabled, row.values) if row else None


def test_crud_and_unique_names(api, relu):
    created = ok(
        api.post(
            "/api/profiles",
            {
                "name": "dogs-40",
                "description": "a dog feature",
                "steering": {"12": 40, "4": -10},
                "model_id": "tiny-llama",
            },
            format="json",
        ),
        201,
    )
    assert created["sae_id"] == relu.id and created["layer"] == 1  # the only attachment
    assert created["steering"] == {"4": -10.0, "12": 40.0} and created["is_active"] is False
    row = Profile.objects.get(name="dogs-40")
    assert (row.sae_id, row.layer, row.steering, row.model_name) == (relu.id, 1, {"4": -10.0, "12": 40.0}, "tiny-llama")
    refused(
        api.post("/api/profiles", {"name": "dogs-40", "steering": {}}, format="json"), 409, "PROFILE_ALREADY_EXISTS"
    )
    refused(api.post("/api/profiles", {"name": "bad", "steering": {"1": 250}}, format="json"), 422, "VALIDATION_ERROR")
    # a layer past any model's (found by schemathesis: it reached PostgreSQL as a 500)
    refused(
        api.post("/api/profiles", {"name": "bad", "steering": {}, "layer": 2**40}, format="json"),
        422,
        "VALIDATION_ERROR",
    )
    assert ok(api.get(f"/api/profiles/{row.id}"))["name"] == "dogs-40"
    assert ok(api.get("/api/profiles/dogs-40"))["id"] == row.id
    listed = ok(api.get("/api/profiles"))
    assert listed["total"] == 1 and listed["profiles"][0]["name"] == "dogs-40"

    patched = ok(api.patch(f"/api/profiles/{row.id}", {"steering": {"7": 55}}, format="json"))
    assert patched["steering"] == {"7": 55.0}  # replaces the map
    ok(api.post("/api/profiles", {"name": "other", "steering": {}}, format="json"), 201)
    refused(api.patch(f"/api/profiles/{row.id}", {"name": "other"}, format="json"), 409, "PROFILE_ALREADY_EXISTS")
    ok(api.delete(f"/api/profiles/{row.id}"))
    assert not Profile.objects.filter(name="dogs-40").exists()
    refused(api.get(f"/api/profiles/{row.id}"), 404, "PROFILE_NOT_FOUND")


def test_activate_replaces_live_steering_scaled_and_clamped(api, llama):
    relu = llama.attach("tiny-llama-L1-relu", 1)
    topk = llama.attach("tiny-llama-L2-topk", 2)
    ok(api.post("/api/saes/steering", {"feature_idx": 9, "value": 3, "sae_id": topk.id}, format="json"))
    profile = ok(
        api.post(
            "/api/profiles",
            {"name": "p", "sae_id": relu.id, "layer": 1, "steering": {"1": 150, "2": -20, "3": -190}},
            format="json",
        ),
        201,
    )
    active = ok(api.post(f"/api/profiles/{profile['id']}/activate", {"intensity": 1.5}, format="json"))
    assert active["is_active"] is True and active["intensity"] == 1.5
    # 150 × 1.5 = 225 → 200; -20 × 1.5 = -30; -190 × 1.5 = -285 → -200
    assert _live(relu, 1) == (True, {"1": 200.0, "2": -30.0, "3": -200.0})
    assert _live(topk, 2) is None  # replaced: the other attachment's steering is gone
    assert LiveSteering.objects.get(attachment__sae_id=relu.id).source == "profile"
    assert ok(api.get("/api/profiles/active"))["name"] == "p"
    assert Profile.objects.get(name="p").is_active

    empty = ok(api.post("/api/profiles", {"name": "clean", "steering": {}}, format="json"), 201)
    ok(api.post(f"/api/profiles/{empty['id']}/activate"))
    assert _live(relu, 1) is None  # an empty profile is the way back to unsteered
    assert list(Profile.objects.filter(is_active=True).values_list("name", flat=True)) == ["clean"]
    ok(api.post(f"/api/profiles/{empty['id']}/deactivate"))
    assert ok(api.get("/api/profiles/active")) is None


def test_a_detached_sae_ends_the_profile_that_steered_through_it(api, llama):
    relu = llama.attach("tiny-llama-L1-relu", 1)
    topk = llama.attach("tiny-llama-L2-topk", 2)
    profile = ok(
        api.post("/api/profiles", {"name": "p", "sae_id": relu.id, "layer": 1, "steering": {"1": 15}}, format="json"),
        201,
    )
    ok(api.post(f"/api/profiles/{profile['id']}/activate"))
    ok(api.post(f"/api/saes/{topk.id}/detach", {}, format="json"))
    assert ok(api.get("/api/profiles/active"))["name"] == "p"  # another SAE: still serving
    ok(api.post(f"/api/saes/{relu.id}/detach", {}, format="json"))
    assert ok(api.get("/api/profiles/active")) is None
    assert ok(api.get("/api/health/detailed"))["active_profile"] is None
    # attached again it starts unsteered, and nothing claims otherwise
    llama.attach("tiny-llama-L1-relu", 1)
    assert ok(api.get("/api/saes/steering"))["values"] == {}
    assert ok(api.get("/api/profiles/active")) is None


def test_activation_is_validated_before_anything_changes(api, llama):
    relu = llama.attach("tiny-llama-L1-relu", 1)
    ok(api.post("/api/saes/steering", {"feature_idx": 5, "value": 7}, format="json"))
    out_of_range = Profile.objects.create(name="wide", sae_id=relu.id, layer=1, steering={"1": 3.0, "300": 2.0})
    refused(api.post(f"/api/profiles/{out_of_range.id}/activate"), 400, "INVALID_FEATURE_INDEX")
    elsewhere = Profile.objects.create(name="elsewhere", sae_id=relu.id, layer=3, steering={"1": 3.0})
    refused(api.post(f"/api/profiles/{elsewhere.id}/activate"), 400, "SAE_NOT_ATTACHED")
    other_model = Profile.objects.create(
        name="gpt", sae_id=relu.id, layer=1, model_name="tiny-gpt2", steering={"1": 3.0}
    )
    refused(api.post(f"/api/profiles/{other_model.id}/activate"), 400, "PROFILE_INCOMPATIBLE")
    refused(
        api.post(f"/api/profiles/{elsewhere.id}/activate", {"intensity": 3}, format="json"), 422, "VALIDATION_ERROR"
    )
    assert _live(relu, 1) == (True, {"5": 7.0})  # untouched by every refusal
    assert not Profile.objects.filter(is_active=True).exists()


def test_save_current_and_deactivate_keeping_values(api, relu):
    refused(api.post("/api/profiles/save-current", {"name": "x", "layer": 3}, format="json"), 400, "SAE_NOT_ATTACHED")
    ok(api.post("/api/saes/steering/batch", {"steering": {"10": 12.5, "11": -3}}, format="json"))
    saved = ok(api.post("/api/profiles/save-current", {"name": "session", "description": "now"}, format="json"), 201)
    assert (saved["sae_id"], saved["layer"], saved["model_id"]) == (relu.id, 1, "tiny-llama")
    assert saved["steering"] == {"10": 12.5, "11": -3.0}
    ok(api.post(f"/api/profiles/{saved['id']}/activate"))
    ok(api.post(f"/api/profiles/{saved['id']}/deactivate?clear_steering=false"))
    assert _live(relu, 1) == (True, {"10": 12.5, "11": -3.0})
    ok(api.post(f"/api/profiles/{saved['id']}/activate"))
    ok(api.delete(f"/api/profiles/{saved['id']}"))  # deleting the active one deactivates
    assert _live(relu, 1) is None


def test_deactivating_says_deactivate_in_its_event(api, relu, published, django_capture_on_commit_callbacks):
    made = ok(
        api.post("/api/profiles", {"name": "p", "sae_id": relu.id, "layer": 1, "steering": {"3": 4}}, format="json"),
        201,
    )
    with django_capture_on_commit_callbacks(execute=True):
        ok(api.post(f"/api/profiles/{made['id']}/activate"))
    assert published[-1][1]["reason"] == "activate"
    with django_capture_on_commit_callbacks(execute=True):
        ok(api.post(f"/api/profiles/{made['id']}/deactivate"))
    assert published[-1][0] == "steering:update"
    assert (published[-1][1]["reason"], published[-1][1]["values"]) == ("deactivate", {})


def test_export_import_round_trip_is_lossless(api, relu):
    made = ok(
        api.post(
            "/api/profiles",
            {
                "name": "round",
                "description": "trip",
                "steering": {"3": 1.25, "17": -0.5},
                "model_id": "tiny-llama",
                "intensity": 0.75,
            },
            format="json",
        ),
        201,
    )
    response = api.get(f"/api/profiles/{made['id']}/export")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    exported = json.loads(response.content)
    assert exported == {
        "version": "1.0",
        "name": "round",
        "description": "trip",
        "model_id": "tiny-llama",
        "sae_id": relu.id,
        "layer": 1,
        "steering": {"3": 1.25, "17": -0.5},
        "intensity": 0.75,
        "created_at": made["created_at"],
        "updated_at": made["updated_at"],
    }
    refused(api.post("/api/profiles/import", exported, format="json"), 409, "PROFILE_ALREADY_EXISTS")
    ok(api.delete(f"/api/profiles/{made['id']}"))
    imported = ok(api.post("/api/profiles/import", response.content, content_type="application/json"), 201)
    again = json.loads(api.get(f"/api/profiles/{imported['id']}/export").content)
    assert again == exported
    renamed = ok(api.post("/api/profiles/import?on_conflict=rename", exported, format="json"), 201)
    assert renamed["name"] == "round (2)"


def test_import_forms_and_refusals(api, relu):
    features = ok(
        api.post(
            "/api/profiles/import",
            {
                "version": "1.0",
                "name": "listed",
                "sae_id": relu.id,
                "layer": 1,
                "features": [{"index": 185, "strength": 22.8}, {"index": 3, "strength": 15}],
            },
            format="json",
        ),
        201,
    )
    assert features["steering"] == {"3": 15.0, "185": 22.8}
    # indices are checked against the SAE's d_sae (256) when it is registered here
    error = refused(
        api.post(
            "/api/profiles/import",
            {"name": "wide", "sae_id": relu.id, "layer": 1, "features": [{"index": 11859, "strength": 22.8}]},
            format="json",
        ),
        400,
        "INVALID_FEATURE_INDEX",
    )
    assert (error["details"]["feature_idx"], error["details"]["d_sae"]) == (11859, 256)
    error = refused(
        api.post(
            "/api/profiles/import",
            {"name": "bad", "sae_id": relu.id, "layer": 1, "steering": {"1": 2, "one": 3, "2": "x", "-4": 1}},
            format="json",
        ),
        422,
        "VALIDATION_ERROR",
    )
    assert set(error["details"]["invalid_keys"]) == {"one", "2", "-4"}
    cluster = {
        "kind": "mistudio.cluster-definition",
        "schema_version": "1",
        "name": "c",
        "members": [{"feature_idx": 1, "strength": 2}],
    }
    response = api.post("/api/profiles/import", cluster, format="json")
    assert response.status_code == 200  # a decision about a well-formed body
    assert body(response)["error"]["code"] == "IS_CLUSTER_DOCUMENT"
    refused(api.post("/api/profiles/import", {"version": "2", "name": "v2"}, format="json"), 422, "VALIDATION_ERROR")
    assert set(Profile.objects.values_list("name", flat=True)) == {"listed"}


def _route_words() -> set[str]:
    """The fixed words after /api/profiles/ in the URL conf, read from it."""
    from steering.urls import urlpatterns

    words = set()
    for pattern in urlpatterns:
        route = str(pattern.pattern)
        if route.startswith("profiles/") and route.count("/") == 1 and "<" not in route:
            words.add(route.removeprefix("profiles/"))
    return words


def test_names_a_route_would_shadow_are_refused(api, relu):
    words = _route_words()
    assert words == {"active", "import", "save-current"}
    for name in [*sorted(words), "1", "0042", "a/b", "calm@2"]:
        refused(api.post("/api/profiles", {"name": name, "steering": {}}, format="json"), 422, "VALIDATION_ERROR")
        refused(
            api.post("/api/profiles/import", {"name": name, "steering": {}}, format="json"), 422, "VALIDATION_ERROR"
        )
        refused(
            api.post("/api/profiles/import?on_conflict=rename", {"name": name, "steering": {}}, format="json"),
            422,
            "VALIDATION_ERROR",
        )
    refused(api.post("/api/profiles/save-current", {"name": "active"}, format="json"), 422, "VALIDATION_ERROR")
    assert not Profile.objects.exists()
    # names that only contain such words or digits are fine, and reachable by name
    for name in ("active-2", "1a", "import me"):
        made = ok(api.post("/api/profiles", {"name": name, "steering": {}}, format="json"), 201)
        assert ok(api.get(f"/api/profiles/{name}"))["id"] == made["id"]
    made = Profile.objects.get(name="1a")
    error = refused(api.patch(f"/api/profiles/{made.pk}", {"name": "7"}, format="json"), 422, "VALIDATION_ERROR")
    assert error["details"]["fields"]["name"]
    refused(api.patch(f"/api/profiles/{made.pk}", {"name": "active"}, format="json"), 422, "VALIDATION_ERROR")
    assert Profile.objects.get(pk=made.pk).name == "1a"


def test_indices_are_checked_against_d_sae_when_saved(api, relu):
    error = refused(
        api.post("/api/profiles", {"name": "wide", "steering": {"5000": 5}}, format="json"),
        400,
        "INVALID_FEATURE_INDEX",
    )
    assert (error["details"]["feature_idx"], error["details"]["d_sae"]) == (5000, 256)
    refused(
        api.post(
            "/api/profiles",
            {"name": "wide", "steering": {}, "controls": [{"index": 256, "mode": "ablate"}]},
            format="json",
        ),
        400,
        "INVALID_FEATURE_INDEX",
    )
    refused(
        api.post(
            "/api/profiles",
            {
                "name": "wide",
                "steering": {},
                "controls": [{"index": 1, "mode": "clamp", "value": 1, "condition": {"feature": 999}}],
            },
            format="json",
        ),
        400,
        "INVALID_FEATURE_INDEX",
    )
    assert not Profile.objects.exists()
    made = ok(api.post("/api/profiles", {"name": "edge", "steering": {"255": 5}}, format="json"), 201)
    refused(
        api.patch(f"/api/profiles/{made['id']}", {"steering": {"256": 5}}, format="json"), 400, "INVALID_FEATURE_INDEX"
    )
    assert Profile.objects.get(pk=made["id"]).steering == {"255": 5.0}
    # an SAE not registered here is checked when the profile activates
    later = ok(
        api.post(
            "/api/profiles",
            {"name": "later", "sae_id": "sae_elsewhere", "layer": 3, "steering": {"5000": 5}},
            format="json",
        ),
        201,
    )
    assert later["steering"] == {"5000": 5.0}


def test_profile_numbers_are_json_numbers(api, relu):
    for sent in ({"intensity": True}, {"intensity": "0.5"}, {"layer": "1"}, {"layer": True}):
        refused(
            api.post("/api/profiles", {"name": "p", "steering": {}, **sent}, format="json"), 422, "VALIDATION_ERROR"
        )
    made = ok(
        api.post(
            "/api/profiles", {"name": "p", "steering": {}, "intensity": 1, "layer": 1, "sae_id": relu.id}, format="json"
        ),
        201,
    )
    refused(api.patch(f"/api/profiles/{made['id']}", {"intensity": "0.5"}, format="json"), 422, "VALIDATION_ERROR")
    assert Profile.objects.get(pk=made["id"]).intensity == 1.0


ORIGINAL_REPO = "google/gemma-scope-2b-pt-res"


def _original(name, sae, **extra):
    """The original miLLM's documented export (manual/docs/features/profiles.md)."""
    return {
        "version": "1.0",
        "name": name,
        "description": "from the original",
        "model": {"repo_id": "google/gemma-2-2b-it", "quantization": "Q4"},
        "sae": sae,
        "features": [{"index": 1, "strength": 2}, {"index": 200, "strength": -3.5}],
        "exported_at": "2026-03-24T10:00:00Z",
        **extra,
    }


def test_the_originals_export_imports_against_the_registry(api, relu, llama):
    from registry.models import SAE, Model

    SAE.objects.filter(pk=relu.pk).update(repository_id=ORIGINAL_REPO, file_path="layer_1/width_256/average_l0_8")
    Model.objects.filter(pk=llama.model.pk).update(repo_id="google/gemma-2-2b-it")
    assert SAE.objects.get(pk=relu.pk).trained_on_layer == 1

    made = ok(
        api.post("/api/profiles/import", _original("o", {"repo_id": ORIGINAL_REPO, "layer": 1}), format="json"), 201
    )
    assert (made["sae_id"], made["layer"], made["model_id"], made["steering"]) == (
        relu.id,
        1,
        "tiny-llama",
        {"1": 2.0, "200": -3.5},
    )
    row = Profile.objects.get(name="o")
    assert (row.sae_id, row.layer, row.model_name) == (relu.id, 1, "tiny-llama")
    ok(api.post(f"/api/profiles/{made['id']}/activate"))  # it steers what is attached
    assert _live(relu, 1) == (True, {"1": 2.0, "200": -3.5})
    # the layer may be left to the SAE's own; the SAE may be named by its id here
    assert (
        ok(api.post("/api/profiles/import", _original("o2", {"repo_id": ORIGINAL_REPO}), format="json"), 201)["layer"]
        == 1
    )
    assert (
        ok(api.post("/api/profiles/import", _original("o3", {"id": relu.id, "layer": 1}), format="json"), 201)["sae_id"]
        == relu.id
    )

    # two SAEs of the repository at that layer: the file path chooses
    wide = SAE.objects.create(
        name="wide",
        repository_id=ORIGINAL_REPO,
        format="gemmascope",
        file_path="layer_1/width_1k/average_l0_20",
        d_sae=1024,
        trained_on_layer=1,
    )
    error = refused(
        api.post("/api/profiles/import", _original("o4", {"repo_id": ORIGINAL_REPO, "layer": 1}), format="json"),
        400,
        "AMBIGUOUS_SAE",
    )
    assert sorted(error["details"]["choices"]) == sorted([f"{relu.id}@1", f"{wide.id}@1"])
    picked = ok(
        api.post(
            "/api/profiles/import",
            _original(
                "o4",
                {"repo_id": ORIGINAL_REPO, "layer": 1, "file_path": "layer_1/width_1k/average_l0_20"},
                features=[{"index": 1000, "strength": 1}],
            ),
            format="json",
        ),
        201,
    )
    assert (picked["sae_id"], picked["steering"]) == (wide.id, {"1000": 1.0})

    # what resolves to nothing is refused, naming what was looked for
    error = refused(
        api.post("/api/profiles/import", _original("o5", {"repo_id": ORIGINAL_REPO, "layer": 20}), format="json"),
        404,
        "SAE_NOT_FOUND",
    )
    assert error["details"]["sae"] == {"repo_id": ORIGINAL_REPO, "layer": 20}
    assert "layer=20" in error["message"]
    error = refused(
        api.post("/api/profiles/import", _original("o5", {"id": "sae_0123456789ab", "layer": 12}), format="json"),
        404,
        "SAE_NOT_FOUND",
    )
    assert error["details"]["sae"] == {"id": "sae_0123456789ab"}
    error = refused(
        api.post(
            "/api/profiles/import",
            _original("o5", {"id": relu.id, "layer": 1}, model={"repo_id": "google/gemma-2-9b-it"}),
            format="json",
        ),
        404,
        "MODEL_NOT_FOUND",
    )
    assert error["details"]["model"] == {"repo_id": "google/gemma-2-9b-it"}
    refused(
        api.post(
            "/api/profiles/import",
            _original("o5", {"id": relu.id, "layer": 1}, features=[{"index": 256, "strength": 1}]),
            format="json",
        ),
        400,
        "INVALID_FEATURE_INDEX",
    )
    assert set(Profile.objects.values_list("name", flat=True)) == {"o", "o2", "o3", "o4"}
