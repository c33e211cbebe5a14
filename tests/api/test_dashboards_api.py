"""Feature dashboards and search under /api (docs/api.md, "Feature dashboards"), through
the test client on PostgreSQL with three keys: alice and bob (inference keys) and root
(admin). A run is its owner's: another inference key gets 404 on it and on its corpus
file, and nothing is created or changed by a refusal. Read routes are checked on rows the
test writes itself (a completed run's figures), so what they answer is the test's own."""

from __future__ import annotations

import json

import pytest
from django.urls import resolve

from batches.files import file_create
from features import apis
from features.models import DashboardRun, FeatureDashboard
from orchestration import tasks
from registry.models import FeatureExplanation
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db

ALICE, BOB, ROOT = "alice-dash-0123456789", "bob-dash-0123456789", "root-dash-0123456789"
SAE = "tiny-llama-L1-relu"
CAP = 5000


@pytest.fixture
def keys(settings, tmp_path):
    settings.MILLM_API_KEYS = [f"alice:{ALICE}", f"bob:{BOB}"]
    settings.MILLM_ADMIN_API_KEYS = [f"root:{ROOT}"]
    settings.DASHBOARD_MAX_TOKENS = CAP
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    return settings


def as_(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.fixture
def attached(api, keys, engine_client, tiny_llama, llama_saes):
    """tiny-llama resident with the L1 SAE attached at layer 1 (by the admin key)."""
    data = ok(api.post(f"/api/models/{tiny_llama.id}/load", **as_(ROOT)), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    sae = llama_saes[SAE]
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json", **as_(ROOT)))
    return sae


@pytest.fixture
def sae(keys, llama_saes):
    """The L1 SAE, registered (d_sae 256), with no model loaded: the read routes need none."""
    return llama_saes[SAE]


def alice_file(text_field: str = "text") -> str:
    lines = [json.dumps({text_field: f"line {i} of alice's corpus"}) for i in range(4)]
    return file_create(
        filename="corpus.jsonl", purpose="batch", content="\n".join(lines).encode(), owner="key:alice"
    ).id


def start(api, sae_id: str, body: dict, key: str = ALICE):
    return api.post(f"/api/saes/{sae_id}/dashboards", body, format="json", **as_(key))


# --------------------------------------------------------------------------- wiring


def test_the_routes_are_wired_under_api():
    """Fails if features.urls is not included under /api (or is shadowed by another app)."""
    expected = {
        "/api/saes/sae_abc/dashboards": apis.DashboardListCreateApi,
        "/api/dashboards/dash_0123456789abcdef": apis.DashboardDetailApi,
        "/api/dashboards/dash_0123456789abcdef/cancel": apis.DashboardCancelApi,
        "/api/saes/sae_abc/features": apis.FeatureSearchApi,
        "/api/saes/sae_abc/features/12": apis.FeatureDetailApi,
    }
    for url, view in expected.items():
        assert resolve(url).func.view_class is view, url
    # the fixed saes/... routes of other apps still win over an SAE id
    assert resolve("/api/saes/steering").func.view_class.__module__ == "steering.apis"


# --------------------------------------------------------------------------- runs


def test_start_list_get_and_cancel_a_run(api, attached):
    data = ok(start(api, attached.id, {"corpus": "sample", "token_budget": 512, "context_tokens": 16}), 202)
    run = data["run"]
    row = DashboardRun.objects.get()
    assert run["id"] == row.id and row.id.startswith("dash_")
    assert (row.owner, row.sae_id, row.layer, row.corpus, row.token_budget, row.context_tokens) == (
        "key:alice",
        attached.id,
        1,
        "sample",
        512,
        16,
    )
    assert run == {
        "id": row.id,
        "sae_id": attached.id,
        "layer": 1,
        "status": "queued",
        "complete": False,
        "corpus": "sample",
        "corpus_file_id": None,
        "text_field": None,
        "token_budget": 512,
        "context_tokens": 16,
        "top_k": 10,
        "window": 8,
        "contexts_done": 0,
        "contexts_total": row.contexts_total,
        "tokens_done": 0,
        "error": None,
        "summary": {},
        "created_at": run["created_at"],
        "started_at": None,
        "finished_at": None,
    }
    assert ok(api.get(f"/api/dashboards/{row.id}", **as_(ALICE))) == run
    assert ok(api.get(f"/api/dashboards/{row.id}", **as_(ROOT)))["id"] == row.id

    listed = ok(api.get(f"/api/saes/{attached.id}/dashboards", **as_(ALICE)))
    assert listed == {"runs": [run], "total": 1}
    assert ok(api.get(f"/api/saes/{attached.id}/dashboards", **as_(BOB))) == {"runs": [], "total": 0}
    assert ok(api.get(f"/api/saes/{attached.id}/dashboards", **as_(ROOT)))["total"] == 1

    # no runner holds a queued run (nothing committed here dispatches it): cancelled at once
    cancelled = ok(api.post(f"/api/dashboards/{row.id}/cancel", **as_(ALICE)))
    assert (cancelled["id"], cancelled["status"], cancelled["complete"]) == (row.id, "cancelled", False)
    assert cancelled["finished_at"] is not None
    assert DashboardRun.objects.get().status == "cancelled"
    assert FeatureDashboard.objects.count() == 0
    assert ok(api.post(f"/api/dashboards/{row.id}/cancel", **as_(ALICE)))["status"] == "cancelled"


def test_a_run_that_ended_cannot_be_cancelled(api, sae):
    run = completed_run(sae)
    refused(api.post(f"/api/dashboards/{run.id}/cancel", **as_(ALICE)), 409, "DASHBOARD_NOT_CANCELLABLE")
    assert DashboardRun.objects.get().status == "completed"


def test_a_run_over_the_callers_own_file(api, attached):
    file_id = alice_file("body")
    body = {"corpus": "file", "file_id": file_id, "text_field": "body", "token_budget": 64}
    run = ok(start(api, attached.id, body), 202)["run"]
    assert (run["corpus"], run["corpus_file_id"], run["text_field"]) == ("file", file_id, "body")
    row = DashboardRun.objects.get()
    assert (row.owner, row.corpus_file_id, row.text_field) == ("key:alice", file_id, "body")


def test_a_run_over_a_text_lines_user_data_file(api, attached):
    """A corpus of plain text lines is a /v1/files upload of purpose user_data; its text
    is read whole by the corpus reader (a JSONL text_field is not asked of it)."""
    text = "\n".join(f"plain line {i} of alice's notes" for i in range(6)).encode()
    file_id = file_create(filename="notes.txt", purpose="user_data", content=text, owner="key:alice").id
    run = ok(start(api, attached.id, {"corpus": "file", "file_id": file_id, "token_budget": 64}), 202)["run"]
    assert (run["corpus"], run["corpus_file_id"]) == ("file", file_id)
    refused(
        start(api, attached.id, {"corpus": "file", "file_id": file_id, "token_budget": 64}, key=BOB),
        404,
        error_code_of_file(),
    )


def test_another_keys_run_is_404_and_unchanged(api, attached):
    run = ok(start(api, attached.id, {"corpus": "sample", "token_budget": 64}), 202)["run"]
    refused(api.get(f"/api/dashboards/{run['id']}", **as_(BOB)), 404, "DASHBOARD_NOT_FOUND")
    refused(api.post(f"/api/dashboards/{run['id']}/cancel", **as_(BOB)), 404, "DASHBOARD_NOT_FOUND")
    assert DashboardRun.objects.get().status == "queued"
    # the admin may cancel anyone's
    assert ok(api.post(f"/api/dashboards/{run['id']}/cancel", **as_(ROOT)))["status"] == "cancelled"
    assert DashboardRun.objects.get().status == "cancelled"


def test_an_unknown_run_is_404(api, keys):
    for run_id in ("dash_0123456789abcdef", "nope", "..", "dash_" + "f" * 59):
        refused(api.get(f"/api/dashboards/{run_id}", **as_(ROOT)), 404, "DASHBOARD_NOT_FOUND")
        refused(api.post(f"/api/dashboards/{run_id}/cancel", **as_(ROOT)), 404, "DASHBOARD_NOT_FOUND")


def test_inference_keys_may_start_runs_but_not_other_admin_actions(api, attached):
    ok(start(api, attached.id, {"corpus": "sample", "token_budget": 64}), 202)
    refused(api.post(f"/api/saes/{attached.id}/detach", {"layer": 1}, format="json", **as_(ALICE)), 403, "FORBIDDEN")
    refused(
        api.post("/api/saes/steering", {"feature_idx": 1, "value": 1}, format="json", **as_(ALICE)), 403, "FORBIDDEN"
    )
    refused(api.post(f"/api/saes/{attached.id}/dashboards", {}, format="json"), 401, "UNAUTHORIZED")


# --------------------------------------------------------------------------- refusals


BAD_BODIES = [
    ({"token_budget": 64}, "corpus"),
    ({"corpus": "web", "token_budget": 64}, "corpus"),
    ({"corpus": "sample"}, "token_budget"),
    ({"corpus": "sample", "token_budget": 0}, "token_budget"),
    ({"corpus": "sample", "token_budget": CAP + 1}, "token_budget"),
    ({"corpus": "sample", "token_budget": "64"}, "token_budget"),
    ({"corpus": "sample", "token_budget": 6.5}, "token_budget"),
    ({"corpus": "sample", "token_budget": 64, "context_tokens": 7}, "context_tokens"),
    ({"corpus": "sample", "token_budget": 64, "context_tokens": 1025}, "context_tokens"),
    ({"corpus": "sample", "token_budget": 64, "top_k": 0}, "top_k"),
    ({"corpus": "sample", "token_budget": 64, "top_k": 101}, "top_k"),
    ({"corpus": "sample", "token_budget": 64, "window": -1}, "window"),
    ({"corpus": "sample", "token_budget": 64, "window": 65}, "window"),
    ({"corpus": "sample", "token_budget": 64, "layer": "1"}, "layer"),
    ({"corpus": "sample", "token_budget": 64, "layer": -1}, "layer"),
    ({"corpus": "file", "token_budget": 64}, "file_id"),
    ({"corpus": "sample", "file_id": "file-abc", "token_budget": 64}, "file_id"),
    ({"corpus": "sample", "token_budget": 64, "text_field": "../../etc/passwd"}, "text_field"),
    ({"corpus": "sample", "token_budget": 64, "text_field": "/etc/passwd"}, "text_field"),
    ({"corpus": "sample", "token_budget": 64, "text_field": "t" * 101}, "text_field"),
    ({"corpus": "sample", "token_budget": 64, "text_field": ""}, "text_field"),
    ({"corpus": "sample", "token_budget": 64, "owner": "key:bob"}, "owner"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_a_bad_body_is_422_naming_the_field_and_creates_nothing(api, sae, body, field):
    error = refused(start(api, sae.id, body), 422, "VALIDATION_ERROR")
    assert field in error["details"]["fields"], error
    assert DashboardRun.objects.count() == 0


def test_a_budget_above_the_cap_is_refused_naming_the_setting(api, sae):
    error = refused(start(api, sae.id, {"corpus": "sample", "token_budget": CAP + 1}), 422, "VALIDATION_ERROR")
    assert "DASHBOARD_MAX_TOKENS" in error["details"]["fields"]["token_budget"][0]
    assert DashboardRun.objects.count() == 0


def test_another_keys_file_is_404_and_no_run(api, attached):
    file_id = alice_file()
    body = {"corpus": "file", "file_id": file_id, "token_budget": 64}
    error = refused(start(api, attached.id, body, key=BOB), 404, error_code_of_file())
    assert file_id in error["message"]
    refused(start(api, attached.id, {**body, "file_id": "file-doesnotexist"}, key=ROOT), 404, error_code_of_file())
    assert DashboardRun.objects.count() == 0
    # the positive control: the file's owner may
    ok(start(api, attached.id, body), 202)
    assert DashboardRun.objects.get().owner == "key:alice"


def test_a_corpus_without_the_text_field_and_an_sae_not_attached_are_refused(api, attached, llama_saes):
    file_id = alice_file("body")
    body = {"corpus": "file", "file_id": file_id, "token_budget": 64}
    error = refused(start(api, attached.id, body), 400, "INVALID_CORPUS")
    assert error["details"]["param"] == "text_field"
    error = refused(
        start(api, attached.id, {"corpus": "sample", "token_budget": 64, "layer": 2}), 409, "SAE_NOT_ATTACHED"
    )
    assert error["details"]["layers"] == [1]
    other = llama_saes["tiny-llama-L3-relu"]
    error = refused(start(api, other.id, {"corpus": "sample", "token_budget": 64}), 409, "SAE_NOT_ATTACHED")
    assert error["details"]["layers"] == []
    assert DashboardRun.objects.count() == 0


def error_code_of_file() -> str:
    return "FILE_NOT_FOUND"


def test_a_10_mb_body_is_413_and_creates_nothing(api, sae):
    body = json.dumps({"corpus": "sample", "token_budget": 64, "text_field": "x" * (10 * 2**20)})
    response = api.post(f"/api/saes/{sae.id}/dashboards", body, content_type="application/json", **as_(ALICE))
    refused(response, 413, "PAYLOAD_TOO_LARGE")
    assert DashboardRun.objects.count() == 0


def test_an_unknown_sae_is_404(api, keys):
    for route in ("dashboards", "features", "features/3"):
        refused(api.get(f"/api/saes/sae_nope/{route}", **as_(ALICE)), 404, "SAE_NOT_FOUND")
    refused(start(api, "sae_nope", {"corpus": "sample", "token_budget": 64}), 404, "SAE_NOT_FOUND")
    assert DashboardRun.objects.count() == 0


# --------------------------------------------------------------------------- features


def completed_run(
    sae, *, complete: bool = True, status: str = "completed", owner: str = "key:alice", file_id: str = ""
) -> DashboardRun:
    return DashboardRun.objects.create(
        sae=sae,
        layer=1,
        owner=owner,
        corpus="file" if file_id else "sample",
        corpus_file_id=file_id,
        token_budget=64,
        status=status,
        complete=complete,
        contexts_total=4,
        contexts_done=4,
        tokens_done=64,
        summary={"tokens": 64, "contexts": 4},
    )


def feature_row(run: DashboardRun, index: int, *, density: float, tokens: str = "", **extra) -> FeatureDashboard:
    fields = dict(
        run=run,
        sae=run.sae,
        index=index,
        count=round(density * 64),
        density=density,
        mean=0.5,
        max=2.0,
        histogram={"edges": [0.0, 1.0, 2.0], "counts": [3, 1]},
        top_contexts=[
            {
                "context": 0,
                "tokens": ["The", " Paris", " sky"],
                "token_ids": [1, 2, 3],
                "activations": [0.0, 2.0, 0.5],
                "max_position": 1,
                "max_activation": 2.0,
            }
        ],
        logit_top=[{"token_id": 9, "token": " Eiffel", "value": 1.25}],
        logit_bottom=[{"token_id": 8, "token": " bread", "value": -0.75}],
        search_tokens=tokens,
    )
    fields.update(extra)
    return FeatureDashboard.objects.create(**fields)


def test_a_feature_with_no_dashboard_yet(api, sae):
    data = ok(api.get(f"/api/saes/{sae.id}/features/7", **as_(BOB)))
    assert data == {"sae_id": sae.id, "index": 7, "label": None, "explanations": [], "dashboard": None, "run_id": None}
    FeatureExplanation.objects.create(sae=sae, index=7, description="French landmarks", source="user")
    data = ok(api.get(f"/api/saes/{sae.id}/features/7", **as_(BOB)))
    assert data["label"] == "French landmarks" and data["dashboard"] is None
    assert [e["description"] for e in data["explanations"]] == ["French landmarks"]


def test_a_feature_with_a_dashboard(api, sae):
    # a cancelled run's rows never show: only a complete run's do
    stale = completed_run(sae, complete=False, status="cancelled")
    feature_row(stale, 5, density=0.9)
    run = completed_run(sae)
    feature_row(run, 5, density=0.125, tokens="the paris sky eiffel bread")
    data = ok(api.get(f"/api/saes/{sae.id}/features/5", **as_(BOB)))
    assert data["run_id"] == run.id and data["index"] == 5
    assert data["dashboard"] == {
        "count": 8,
        "density": 0.125,
        "mean": 0.5,
        "max": 2.0,
        "histogram": {"edges": [0.0, 1.0, 2.0], "counts": [3, 1]},
        "top_contexts": [
            {
                "context": 0,
                "tokens": ["The", " Paris", " sky"],
                "token_ids": [1, 2, 3],
                "activations": [0.0, 2.0, 0.5],
                "max_position": 1,
                "max_activation": 2.0,
            }
        ],
        "quantile_samples": [],
        "logit_top": [{"token_id": 9, "token": " Eiffel", "value": 1.25}],
        "logit_bottom": [{"token_id": 8, "token": " bread", "value": -0.75}],
    }
    # a feature the run did not see (never fired) has no dashboard in it
    assert ok(api.get(f"/api/saes/{sae.id}/features/6", **as_(BOB)))["dashboard"] is None


@pytest.mark.parametrize("index", ["256", "-1", "99999999999999999999", "2147483648"])
def test_an_index_outside_the_sae_is_invalid_feature_index(api, sae, index):
    assert sae.d_sae == 256
    error = refused(api.get(f"/api/saes/{sae.id}/features/{index}", **as_(ALICE)), 400, "INVALID_FEATURE_INDEX")
    assert error["details"]["param"] == "index"
    ok(api.get(f"/api/saes/{sae.id}/features/255", **as_(ALICE)))  # the positive control


def test_search_by_label_and_by_token(api, sae):
    run = completed_run(sae)
    feature_row(run, 3, density=0.25, tokens="the paris sky eiffel bread")
    feature_row(run, 4, density=0.5, tokens="dog puppy bark")
    FeatureExplanation.objects.create(sae=sae, index=4, description="dogs and puppies", source="user")
    FeatureExplanation.objects.create(sae=sae, index=9, description="cats", source="user")

    found = ok(api.get(f"/api/saes/{sae.id}/features", {"q": "puppies"}, **as_(BOB)))
    assert [f["index"] for f in found["features"]] == [4] and found["total"] == 1
    hit = found["features"][0]
    assert (hit["label"], hit["density"], hit["max"]) == ("dogs and puppies", 0.5, 2.0)

    found = ok(api.get(f"/api/saes/{sae.id}/features", {"token": "Paris"}, **as_(BOB)))
    assert [f["index"] for f in found["features"]] == [3] and found["total"] == 1

    assert ok(api.get(f"/api/saes/{sae.id}/features", {"q": "giraffe"}, **as_(BOB))) == {"features": [], "total": 0}


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"q": "x" * 201}, "q"),
        ({"token": "x" * 101}, "token"),
        ({"limit": 0}, "limit"),
        ({"limit": 201}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"offset": -1}, "offset"),
    ],
)
def test_bad_search_queries_are_422(api, sae, query, field):
    error = refused(api.get(f"/api/saes/{sae.id}/features", query, **as_(ALICE)), 422, "VALIDATION_ERROR")
    assert field in error["details"]["fields"]


@pytest.mark.parametrize(
    ("query", "field"), [({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"offset": -1}, "offset")]
)
def test_bad_list_queries_are_422(api, sae, query, field):
    error = refused(api.get(f"/api/saes/{sae.id}/dashboards", query, **as_(ALICE)), 422, "VALIDATION_ERROR")
    assert field in error["details"]["fields"]


def test_a_file_runs_text_is_its_owners_only(api, sae):
    """A run over alice's file holds her text in its top contexts: bob's feature page and
    search read the newest run he may see (the sample's), never hers; alice and the admin
    see hers, the newest."""
    sample = completed_run(sae, owner="key:root")
    feature_row(sample, 5, density=0.25, tokens="the paris sky eiffel bread")
    private = completed_run(sae, file_id="file-alice")
    feature_row(
        private,
        5,
        density=0.5,
        tokens="alice secret diary",
        top_contexts=[{"context": 0, "tokens": [" secret"], "activations": [1.0], "max_position": 0}],
    )
    assert ok(api.get(f"/api/saes/{sae.id}/features/5", **as_(BOB)))["run_id"] == sample.id
    assert ok(api.get(f"/api/saes/{sae.id}/features/5", **as_(ALICE)))["run_id"] == private.id
    assert ok(api.get(f"/api/saes/{sae.id}/features/5", **as_(ROOT)))["run_id"] == private.id
    for query in ({"token": "secret"}, {"q": "diary"}):
        assert ok(api.get(f"/api/saes/{sae.id}/features", query, **as_(BOB))) == {"features": [], "total": 0}
        assert [f["index"] for f in ok(api.get(f"/api/saes/{sae.id}/features", query, **as_(ALICE)))["features"]] == [5]
    assert ok(api.get(f"/api/saes/{sae.id}/features", {"token": "paris"}, **as_(BOB)))["total"] == 1
