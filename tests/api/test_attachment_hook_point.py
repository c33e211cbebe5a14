"""Every place the API shows an attachment says where its SAE hooks: the hook point
(from the SAE's ``hook_name``) and the module it lands on. An SAE trained on
``blocks.2.hook_resid_pre`` attached at layer 2 reads and writes the output of block 1
(``model.layers.1``), not block 2's: the attach answer, the attachment list, the
single-attachment status, the recorded row and the detailed health all say so."""

from __future__ import annotations

import json

import pytest

from orchestration import tasks
from registry.models import Attachment
from tests.api.conftest import ok, run_job
from tests.api.test_local_saes import register, write_saelens

pytestmark = pytest.mark.django_db


def test_the_hook_point_and_module_of_a_resid_pre_sae(api, engine_client, tiny_llama, tmp_path):
    folder = write_saelens(tmp_path / "pre-sae", hook_layer=2)
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps({**cfg, "hook_name": "blocks.2.hook_resid_pre"}))
    sae_id = ok(register(api, local_path=str(folder)), 201)["sae_id"]
    load = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, load["job"]["id"]) == "succeeded"

    attached = ok(api.post(f"/api/saes/{sae_id}/attach", {"layer": 2}, format="json"))
    assert (attached["hook_point"], attached["layer_module_path"]) == ("resid_pre", "model.layers.1")
    row = Attachment.objects.get(sae_id=sae_id)
    assert (row.hook_point, row.layer_module_path) == ("resid_pre", "model.layers.1")

    entries = ok(api.get("/api/saes/attachments"))["entries"]
    assert [(e["sae_id"], e["layer"], e["hook_point"], e["layer_module_path"]) for e in entries] == [
        (sae_id, 2, "resid_pre", "model.layers.1")
    ]
    status = ok(api.get("/api/saes/attachment"))
    assert (status["hook_point"], status["layer_module_path"]) == ("resid_pre", "model.layers.1")
    again = ok(api.post("/api/saes/attach-set", {"attachments": [{"sae_id": sae_id, "layer": 2}]}, format="json"))
    assert [(a["status"], a["hook_point"]) for a in again["attachments"]] == [("already_attached", "resid_pre")]
    health = ok(api.get("/api/health/detailed"))
    assert [(a["sae_id"], a["hook_point"], a["layer_module_path"]) for a in health["attachments"]] == [
        (sae_id, "resid_pre", "model.layers.1")
    ]


def test_a_resid_post_sae_reports_its_own_block(api, engine_client, tiny_llama, tmp_path):
    folder = write_saelens(tmp_path / "post-sae", hook_layer=1)
    sae_id = ok(register(api, local_path=str(folder)), 201)["sae_id"]
    load = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, load["job"]["id"]) == "succeeded"
    attached = ok(api.post(f"/api/saes/{sae_id}/attach", {"layer": 1}, format="json"))
    assert (attached["hook_point"], attached["layer_module_path"]) == ("resid_post", "model.layers.1")
    entries = ok(api.get("/api/saes/attachments"))["entries"]
    assert [(e["hook_point"], e["layer_module_path"]) for e in entries] == [("resid_post", "model.layers.1")]
