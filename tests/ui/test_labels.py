"""The feature labels route the steering page searches: the SAE folder's
feature_labels.json as {index: label}, nothing when there is none, the API key when keys
are configured. (The browser tests use the tiny SAEs, which ship no labels.)"""

from __future__ import annotations

import json
import shutil

import pytest

from registry import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def labelled_sae(tiny_assets, tmp_path):
    folder = tmp_path / "labelled"
    shutil.copytree(tiny_assets.saes["tiny-llama-L1-relu"].path, folder)
    (folder / "feature_labels.json").write_text(
        json.dumps({"0": "ocean / sea", "3": "formal register", "x": "not an index", "5": 7})
    )
    return services.sae_register_local(local_path=str(folder), name="labelled")


def test_labels_come_from_the_sae_folder(client, labelled_sae, tiny_assets):
    response = client.get(f"/ui/saes/{labelled_sae.id}/labels")
    assert response.status_code == 200
    assert response.json() == {"sae_id": labelled_sae.id, "labels": {"0": "ocean / sea", "3": "formal register"}}
    plain = services.sae_register_local(local_path=str(tiny_assets.saes["tiny-llama-L3-relu"].path), name="plain")
    assert client.get(f"/ui/saes/{plain.id}/labels").json()["labels"] == {}
    assert client.get("/ui/saes/sae_0000000000000000/labels").status_code == 404


def test_labels_need_the_key_when_keys_are_set(client, labelled_sae, settings):
    settings.MILLM_API_KEYS = ("k-123",)
    url = f"/ui/saes/{labelled_sae.id}/labels"
    assert client.get(url).status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Bearer k-123").status_code == 200
    # the pages themselves hold no data and stay open
    assert client.get("/steering/").status_code == 200


def test_static_files_are_served_without_a_reverse_proxy(client):
    response = client.get("/static/ui/js/api.js")
    assert response.status_code == 200
    assert b"export async function api" in b"".join(response.streaming_content)
    assert client.get("/static/ui/js/missing.js").status_code == 404
