"""Feature explanations and labels under /api/saes/{id}/explanations (docs/api.md "Feature
explanations", docs/features.md): Neuronpedia's export form imported and exported, rows of
another SAE skipped and counted, malformed rows refused naming the row with nothing stored,
sizes, keys and indices tried as an attacker would; a feature's label is its best
explanation; the explainer against a fake OpenAI-compatible server in the test's own thread
(what the prompt carries, the held-out score's arithmetic)."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from rest_framework.test import APIClient

from features import explainer
from features.models import DashboardRun, FeatureDashboard
from registry import explanations, labels, services
from registry.models import FeatureExplanation
from tests.envelope import ok, refused

pytestmark = pytest.mark.django_db

ADMIN, USER = "root-expl-0123456789", "alice-expl-0123456789"
NP_ID = "tiny-llama/1-res-test"


def as_(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.fixture
def api(settings):
    settings.MILLM_API_KEYS = [f"alice:{USER}"]
    settings.MILLM_ADMIN_API_KEYS = [f"root:{ADMIN}"]
    return APIClient()


def _sae_copy(tiny_assets, tmp_path, name: str, *, neuronpedia_id: str | None = None, labels_file=None):
    folder = tmp_path / name
    shutil.copytree(tiny_assets.saes["tiny-llama-L1-relu"].path, folder)
    if neuronpedia_id is not None:
        cfg = json.loads((folder / "cfg.json").read_text())
        cfg["neuronpedia_id"] = neuronpedia_id
        (folder / "cfg.json").write_text(json.dumps(cfg))
    if labels_file is not None:
        (folder / "feature_labels.json").write_text(json.dumps(labels_file))
    return services.sae_register_local(local_path=str(folder), name=name)


@pytest.fixture
def sae(tiny_assets, tmp_path):
    return _sae_copy(tiny_assets, tmp_path, "np-sae", neuronpedia_id=NP_ID)


def np_rows(model: str, layer: str, rows: list[tuple]) -> list[dict]:
    return [
        {
            "modelId": model,
            "layer": layer,
            "index": index,
            "description": text,
            "explanationModelName": "gpt-4o-mini",
            "typeName": "oai_token-act-pair",
        }
        for index, text in rows
    ]


def upload(api, sae_id: str, content: bytes, key: str = ADMIN, name: str = "export.json", **extra):
    return api.post(
        f"/api/saes/{sae_id}/explanations/import",
        {"file": SimpleUploadedFile(name, content, content_type="application/json"), **extra},
        format="multipart",
        **as_(key),
    )


# --------------------------------------------------------------------------- import / export


def test_cfg_neuronpedia_id_is_read_at_registration(sae, tiny_assets, tmp_path):
    assert sae.neuronpedia_id == NP_ID
    plain = _sae_copy(tiny_assets, tmp_path, "plain")
    assert plain.neuronpedia_id == ""


def test_neuronpedia_import_skips_other_saes_and_round_trips(api, sae, tiny_assets, tmp_path):
    mine = [("3", "ocean and sea words"), (7, "formal register")]
    other = [(4, "a layer-2 feature")]
    export = np_rows("tiny-llama", "1-res-test", mine) + np_rows("tiny-llama", "2-res-test", other)
    export += np_rows("gpt2-small", "1-res-test", [(5, "another model's feature")])
    result = ok(upload(api, sae.id, json.dumps(export).encode()))
    assert (result["imported"], result["skipped"], result["duplicates"]) == (2, 2, 0)
    assert labels.labels_for(sae.id) == {3: "ocean and sea words", 7: "formal register"}
    listed = ok(api.get(f"/api/saes/{sae.id}/explanations?index=3", **as_(USER)))
    assert listed["total"] == 1
    row = listed["explanations"][0]
    assert (row["index"], row["source"], row["explainer_model"]) == (3, "neuronpedia", "gpt-4o-mini")
    assert row["provenance"]["typeName"] == "oai_token-act-pair"
    # the same file again stores nothing twice
    again = ok(upload(api, sae.id, json.dumps(export).encode()))
    assert (again["imported"], again["duplicates"], again["skipped"]) == (0, 2, 2)

    # export in the same form (JSONL here) and import it into another SAE with no id
    response = api.get(f"/api/saes/{sae.id}/explanations/export?format=jsonl", **as_(USER))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in response.content.decode().splitlines()]
    assert [(r["modelId"], r["layer"], r["index"], r["description"]) for r in lines] == [
        ("tiny-llama", "1-res-test", "3", "ocean and sea words"),
        ("tiny-llama", "1-res-test", "7", "formal register"),
    ]
    twin = _sae_copy(tiny_assets, tmp_path, "twin")
    got = ok(upload(api, twin.id, response.content, name="export.jsonl"))
    assert (got["imported"], got["skipped"]) == (2, 0)
    assert labels.labels_for(twin.id) == labels.labels_for(sae.id)
    as_json = api.get(f"/api/saes/{twin.id}/explanations/export", **as_(USER))
    assert [r["description"] for r in json.loads(as_json.content)] == ["ocean and sea words", "formal register"]


def test_a_plain_index_description_list_as_the_json_body(api, sae):
    body = [{"index": 1, "description": "first"}, {"index": "2", "description": "  second   one "}]
    result = ok(api.post(f"/api/saes/{sae.id}/explanations/import", body, format="json", **as_(ADMIN)))
    assert result["imported"] == 2
    assert labels.labels_for(sae.id, [1, 2, 3]) == {1: "first", 2: "second one"}


def test_several_neuronpedia_saes_into_an_sae_without_id_needs_one_named(api, tiny_assets, tmp_path):
    plain = _sae_copy(tiny_assets, tmp_path, "plain")
    export = np_rows("m", "1-a", [(1, "one")]) + np_rows("m", "2-b", [(2, "two")])
    error = refused(upload(api, plain.id, json.dumps(export).encode()), 422, "VALIDATION_ERROR")
    assert "neuronpedia_id" in error["details"]["fields"]
    assert not FeatureExplanation.objects.filter(sae=plain).exists()
    result = ok(upload(api, plain.id, json.dumps(export).encode(), neuronpedia_id="m/2-b"))
    assert (result["imported"], result["skipped"]) == (1, 1)
    assert labels.labels_for(plain.id) == {2: "two"}


@pytest.mark.parametrize(
    ("content", "row"),
    [
        (json.dumps([{"index": 1, "description": "ok"}, {"index": 2}]).encode(), 2),
        (json.dumps([{"index": 1, "description": "ok"}, {"index": -4, "description": "x"}]).encode(), 2),
        (json.dumps([{"index": True, "description": "x"}]).encode(), 1),
        (json.dumps([{"index": 0, "description": "ok"}, {"index": 2**40, "description": "x"}]).encode(), 2),
        (json.dumps([{"index": 1, "description": "ok"}, "not an object"]).encode(), 2),
        (b'{"index": 1, "description": "a"}\n{"index": 2, "description": "b"}\n{"index": 3, "descr', 3),
    ],
)
def test_a_malformed_row_is_422_naming_it_and_nothing_is_stored(api, sae, content, row):
    error = refused(upload(api, sae.id, content), 422, "VALIDATION_ERROR")
    assert error["details"]["row"] == row
    assert f"row {row}" in error["message"]
    assert not FeatureExplanation.objects.filter(sae=sae).exists()


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\x00garbage", b"   \n  "])
def test_an_empty_or_binary_file_is_422(api, sae, content):
    refused(upload(api, sae.id, content), 422, "VALIDATION_ERROR")
    assert not FeatureExplanation.objects.filter(sae=sae).exists()


def test_an_oversized_upload_is_413_and_nothing_is_stored(api, sae, monkeypatch):
    monkeypatch.setattr(explanations, "MAX_IMPORT_BYTES", 1000)
    rows = json.dumps([{"index": i, "description": f"feature {i}"} for i in range(60)]).encode()
    assert len(rows) > 1000
    error = refused(upload(api, sae.id, rows), 413, "PAYLOAD_TOO_LARGE")
    assert error["details"]["limit_bytes"] == 1000
    assert not FeatureExplanation.objects.filter(sae=sae).exists()
    # a file under the cap goes in (positive control)
    ok(upload(api, sae.id, rows[:0] + json.dumps([{"index": 1, "description": "small"}]).encode()))


def test_an_index_outside_the_sae_is_invalid_feature_index(api, sae):
    d_sae = sae.d_sae
    error = refused(
        api.post(f"/api/saes/{sae.id}/explanations", {"index": d_sae, "description": "x"}, format="json", **as_(ADMIN)),
        400,
        "INVALID_FEATURE_INDEX",
    )
    assert error["details"]["index"] == d_sae
    refused(api.get(f"/api/saes/{sae.id}/explanations?index={d_sae}", **as_(USER)), 400, "INVALID_FEATURE_INDEX")
    body = np_rows("tiny-llama", "1-res-test", [(1, "fine"), (d_sae + 10, "a bigger SAE's feature")])
    error = refused(upload(api, sae.id, json.dumps(body).encode()), 400, "INVALID_FEATURE_INDEX")
    assert error["details"]["row"] == 2
    assert not FeatureExplanation.objects.filter(sae=sae).exists()
    ok(
        api.post(
            f"/api/saes/{sae.id}/explanations", {"index": d_sae - 1, "description": "x"}, format="json", **as_(ADMIN)
        ),
        201,
    )


def test_inference_keys_read_but_never_write(api, sae, settings):
    settings.EXPLAINER_BASE_URL = "http://127.0.0.1:9/v1"
    row = FeatureExplanation.objects.create(sae=sae, index=1, description="kept", source="user")
    base = f"/api/saes/{sae.id}/explanations"
    refused(api.post(base, {"index": 1, "description": "x"}, format="json", **as_(USER)), 403, "FORBIDDEN")
    refused(upload(api, sae.id, b'[{"index": 2, "description": "y"}]', key=USER), 403, "FORBIDDEN")
    refused(api.delete(f"{base}/{row.id}", **as_(USER)), 403, "FORBIDDEN")
    refused(api.post(f"{base}/generate", {"features": [1]}, format="json", **as_(USER)), 403, "FORBIDDEN")
    assert list(FeatureExplanation.objects.filter(sae=sae).values_list("description", flat=True)) == ["kept"]
    assert ok(api.get(base, **as_(USER)))["total"] == 1
    assert api.get(base).status_code == 401


def test_unknown_sae_and_another_saes_explanation_are_404(api, sae, tiny_assets, tmp_path):
    other = _sae_copy(tiny_assets, tmp_path, "other")
    theirs = FeatureExplanation.objects.create(sae=other, index=1, description="theirs", source="user")
    refused(api.get("/api/saes/sae_0000000000000000/explanations", **as_(USER)), 404, "SAE_NOT_FOUND")
    refused(api.delete(f"/api/saes/{sae.id}/explanations/{theirs.id}", **as_(ADMIN)), 404, "EXPLANATION_NOT_FOUND")
    assert FeatureExplanation.objects.filter(pk=theirs.pk).exists()
    ok(api.delete(f"/api/saes/{other.id}/explanations/{theirs.id}", **as_(ADMIN)))
    assert not FeatureExplanation.objects.filter(pk=theirs.pk).exists()


def test_the_label_is_the_best_explanation(api, sae):
    """Highest score first (an unscored one below every scored one), then the newest."""
    base = f"/api/saes/{sae.id}/explanations"
    ok(api.post(base, {"index": 9, "description": "older"}, format="json", **as_(ADMIN)), 201)
    newer = ok(api.post(base, {"index": 9, "description": "newer"}, format="json", **as_(ADMIN)), 201)
    assert newer["created_by"] == "key:root"
    assert labels.labels_for(sae.id, [9]) == {9: "newer"}
    FeatureExplanation.objects.create(sae=sae, index=9, description="scored low", source="explainer", score=0.2)
    FeatureExplanation.objects.create(sae=sae, index=9, description="scored high", source="explainer", score=0.9)
    FeatureExplanation.objects.create(sae=sae, index=9, description="newest unscored", source="user")
    assert labels.labels_for(sae.id, [9]) == {9: "scored high"}
    listed = ok(api.get(f"{base}?index=9", **as_(USER)))["explanations"]
    assert [r["description"] for r in listed][:3] == ["scored high", "scored low", "newest unscored"]
    best = FeatureExplanation.objects.get(sae=sae, description="scored high")
    ok(api.delete(f"{base}/{best.id}", **as_(ADMIN)))
    assert labels.labels_for(sae.id, [9]) == {9: "scored low"}


def test_the_labels_file_is_imported_once(tiny_assets, tmp_path, client):
    sae = _sae_copy(
        tiny_assets,
        tmp_path,
        "with-labels",
        labels_file={"0": "ocean / sea", "3": "formal", "x": "no", "999999": "big"},
    )
    assert labels.labels_for(sae.id) == {0: "ocean / sea", 3: "formal"}
    assert set(FeatureExplanation.objects.filter(sae=sae).values_list("source", flat=True)) == {"labels_file"}
    FeatureExplanation.objects.filter(sae=sae, index=3).delete()
    labels.forget_imported()  # as a restarted process
    assert labels.labels_for(sae.id) == {0: "ocean / sea"}
    assert client.get(f"/ui/saes/{sae.id}/labels").json()["labels"] == {"0": "ocean / sea"}


# --------------------------------------------------------------------------- the explainer

POSITIVE_WORD, NEGATIVE_WORD = "whale", "invoice"


def window(ctx: int, words: list[str], at: int, acts: list[float]) -> dict:
    return {
        "context": ctx,
        "tokens": words,
        "token_ids": list(range(len(words))),
        "activations": acts,
        "max_position": at,
        "max_activation": acts[at],
        "start": 0,
    }


@pytest.fixture
def dashboard(sae):
    """A complete run the test writes: feature 5 fires on sea words (top contexts 1-3,
    held-out samples 10-11), features 6, 7 and 9 on office words (contexts 20-22): two
    held-out positives and three negatives, so a balanced accuracy differs from a plain one."""
    run = DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=100, status="completed", complete=True, finished_at=timezone.now()
    )
    top = [
        window(1, [" the", " ocean", " waves"], 1, [0.0, 4.0, 1.0]),
        window(2, [" a", " sea", " shell"], 1, [0.0, 3.5, 0.5]),
        window(3, [" blue", " water"], 1, [0.2, 3.0]),
    ]
    samples = [
        {"band": [0.0, 1.0], "contexts": [window(10, [" a", f" {POSITIVE_WORD}", " swims"], 1, [0.0, 0.8, 0.0])]},
        {"band": [1.0, 2.0], "contexts": [window(11, [" the", f" {POSITIVE_WORD}", " sang"], 1, [0.0, 1.5, 0.0])]},
    ]
    FeatureDashboard.objects.create(
        run=run, sae=sae, index=5, count=10, density=0.1, max=4.0, top_contexts=top, quantile_samples=samples
    )
    for index, ctx in ((6, 20), (7, 21), (9, 22)):
        FeatureDashboard.objects.create(
            run=run,
            sae=sae,
            index=index,
            count=3,
            max=2.0,
            top_contexts=[window(ctx, [" the", f" {NEGATIVE_WORD}", " total"], 1, [0.0, 2.0, 0.0])],
        )
    return run


class FakeExplainer:
    """An OpenAI-compatible /v1 in a thread: /models lists one model, /chat/completions
    answers the explain prompt with a fixed label and a scoring prompt with ``judge``."""

    def __init__(self, judge):
        self.judge = judge
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization")})
                self._send({"object": "list", "data": [{"id": "fake-explainer", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                system, user = body["messages"][0]["content"], body["messages"][1]["content"]
                text = "Explanation: sea creatures and the ocean\nsecond line" if system == explainer.SYSTEM else None
                if text is None:
                    text = outer.judge(user)
                self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _generate(api, sae, features, score=True):
    return api.post(
        f"/api/saes/{sae.id}/explanations/generate", {"features": features, "score": score}, format="json", **as_(ADMIN)
    )


def test_the_explainer_reads_the_top_contexts_and_scores_on_held_out_ones(api, sae, dashboard, settings):
    fake = FakeExplainer(lambda prompt: "Yes." if POSITIVE_WORD in prompt else "no")
    with fake as base_url:
        settings.EXPLAINER_BASE_URL, settings.EXPLAINER_MODEL, settings.EXPLAINER_API_KEY = base_url, "", "sk-expl"
        result = ok(_generate(api, sae, [5]))
    assert (result["stored"], result["failed"], result["model"]) == (1, 0, "fake-explainer")
    stored = result["results"][0]["explanation"]
    assert stored["description"] == "sea creatures and the ocean"
    assert stored["source"] == "explainer" and stored["explainer_model"] == "fake-explainer"
    prov = stored["provenance"]
    assert (prov["base_url"], prov["model"], prov["run_id"]) == (base_url, "fake-explainer", dashboard.id)
    assert prov["contexts"] == [1, 2, 3] and prov["prompt_version"] == explainer.PROMPT_VERSION
    # what went over the wire: the model from /models, the key, the marked top contexts
    assert fake.requests[0]["path"] == "/v1/models"
    assert all(r["auth"] == "Bearer sk-expl" for r in fake.requests)
    explain = fake.requests[1]["body"]
    assert fake.requests[1]["path"] == "/v1/chat/completions" and explain["model"] == "fake-explainer"
    prompt = explain["messages"][1]["content"]
    for marked in (" the<< ocean>> waves", " a<< sea>> shell", " blue<< water>>"):
        assert marked in prompt
    assert "' ocean'=4.00" in prompt
    assert POSITIVE_WORD not in prompt and NEGATIVE_WORD not in prompt  # held out
    # 2 held-out positives (the samples), 3 negatives (other features' contexts): all right
    detail = stored["score_detail"]
    assert (detail["method"], detail["positives"], detail["negatives"]) == ("balanced_accuracy", 2, 3)
    assert sorted((p["context"], p["expected"], p["predicted"]) for p in detail["predictions"]) == [
        (10, True, True),
        (11, True, True),
        (20, False, False),
        (21, False, False),
        (22, False, False),
    ]
    assert stored["score"] == 1.0
    assert labels.labels_for(sae.id, [5]) == {5: "sea creatures and the ocean"}


@pytest.mark.parametrize(
    ("judge", "expected"),
    [
        (lambda prompt: "yes", 0.5),  # always yes: every positive, no negative (plain accuracy 0.4)
        (lambda prompt: "no", 0.5),
        (lambda prompt: "no" if POSITIVE_WORD in prompt else "yes", 0.0),
        # one positive of two right, the three negatives right: (1/2 + 1) / 2 (plain: 4/5)
        (lambda prompt: "yes" if f"{POSITIVE_WORD} swims" in prompt else "no", 0.75),
    ],
)
def test_the_score_is_the_balanced_accuracy(api, sae, dashboard, settings, judge, expected):
    with FakeExplainer(judge) as base_url:
        settings.EXPLAINER_BASE_URL, settings.EXPLAINER_MODEL = base_url, "named-model"
        result = ok(_generate(api, sae, [5]))
    assert result["model"] == "named-model"
    assert result["results"][0]["explanation"]["score"] == expected


def test_generate_refusals_store_nothing(api, sae, dashboard, settings):
    settings.EXPLAINER_BASE_URL = ""
    refused(_generate(api, sae, [5]), 409, "EXPLAINER_NOT_CONFIGURED")
    calls = []
    with FakeExplainer(lambda prompt: calls.append(prompt) or "yes") as base_url:
        settings.EXPLAINER_BASE_URL = base_url
        error = refused(_generate(api, sae, [5, 8]), 409, "DASHBOARD_MISSING")
        assert error["details"]["index"] == 8
        refused(_generate(api, sae, [sae.d_sae]), 400, "INVALID_FEATURE_INDEX")
        refused(_generate(api, sae, list(range(65))), 422, "VALIDATION_ERROR")
        refused(_generate(api, sae, []), 422, "VALIDATION_ERROR")
    assert calls == []
    assert not FeatureExplanation.objects.filter(sae=sae).exists()


def test_an_unreachable_explainer_is_502_and_stores_nothing(api, sae, dashboard, settings):
    with FakeExplainer(lambda prompt: "yes") as base_url:
        pass  # closed: nothing listens there any more
    settings.EXPLAINER_BASE_URL, settings.EXPLAINER_TIMEOUT_S = base_url, 5
    refused(_generate(api, sae, [5]), 502, "EXPLAINER_FAILED")
    assert not FeatureExplanation.objects.filter(sae=sae).exists()


def test_the_admin_lists_explanations_and_the_neuronpedia_id(staff_client, sae):
    row = FeatureExplanation.objects.create(
        sae=sae, index=12, description="sea creatures", source="explainer", provenance={"model": "m"}, score=0.75
    )
    listing = staff_client.get("/admin/registry/featureexplanation/?q=creatures")
    assert listing.status_code == 200
    assert b"sea creatures" in listing.content and b"0.75" in listing.content
    assert staff_client.get(f"/admin/registry/featureexplanation/{row.pk}/change/").status_code == 200
    saes = staff_client.get("/admin/registry/sae/?q=1-res-test")
    assert saes.status_code == 200 and NP_ID.encode() in saes.content
    assert b"np-sae" in saes.content
