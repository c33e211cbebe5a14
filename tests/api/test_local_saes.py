"""SAEs a researcher trained: registered from a local directory through POST /api/saes
(``source: "local"``), ``manage.py register_sae`` and the admin's add form, all through
``sae_register_local``. The SAEs are written here with numpy (SAELens and Gemma Scope
layouts), so every recorded field is checked against what the test itself wrote."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from django.test import TestCase

from orchestration import tasks
from registry.models import SAE, Attachment, Job
from tests.admin_urls import admin_url
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db

D_IN = 64  # the tiny models' hidden size


def write_saelens(folder: Path, *, d_in: int = D_IN, d_sae: int = 96, hook_layer: int = 1, seed: int = 0) -> Path:
    """A ReLU SAE in the SAELens layout, as a training run leaves it."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file(
        {
            "W_enc": rng.standard_normal((d_in, d_sae), dtype=np.float32) * 0.3,
            "W_dec": rng.standard_normal((d_sae, d_in), dtype=np.float32),
            "b_enc": np.zeros(d_sae, np.float32),
            "b_dec": np.zeros(d_in, np.float32),
        },
        str(folder / "sae_weights.safetensors"),
    )
    (folder / "cfg.json").write_text(
        json.dumps(
            {
                "d_in": d_in,
                "d_sae": d_sae,
                "architecture": "standard",
                "hook_name": f"blocks.{hook_layer}.hook_resid_post",
                "hook_layer": hook_layer,
                "model_name": "my-llama",
                "normalize_activations": "none",
            }
        )
    )
    return folder


def write_gemmascope(folder: Path, *, d_in: int = D_IN, d_sae: int = 48) -> Path:
    """A JumpReLU SAE as Gemma Scope ships it: params.npz alone, naming no layer or model."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    np.savez(
        folder / "params.npz",
        W_enc=rng.standard_normal((d_in, d_sae)).astype(np.float32),
        W_dec=rng.standard_normal((d_sae, d_in)).astype(np.float32),
        b_enc=np.zeros(d_sae, np.float32),
        b_dec=np.zeros(d_in, np.float32),
        threshold=np.full(d_sae, 0.1, np.float32),
    )
    return folder


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def register(api, **body):
    return api.post("/api/saes", {"source": "local", **body}, format="json")


# --- POST /api/saes ----------------------------------------------------------------------


def test_register_a_saelens_directory(api, tmp_path):
    folder = write_saelens(tmp_path / "runs" / "my-sae", d_sae=96, hook_layer=2)
    data = ok(register(api, local_path=str(folder), name="  my first SAE "), 201)
    assert (data["status"], data["job"]) == ("registered", None)
    sae = data["sae"]
    assert sae["id"] == data["sae_id"] and sae["id"].startswith("sae_")
    assert {
        k: sae[k]
        for k in (
            "name",
            "source",
            "repository_id",
            "local_path",
            "format",
            "d_in",
            "d_sae",
            "width",
            "activation",
            "topk_k",
            "trained_on",
            "trained_layer",
            "hook_name",
            "status",
            "download_progress",
            "attached_layers",
        )
    } == {
        "name": "my first SAE",
        "source": "local",
        "repository_id": None,
        "local_path": str(folder),
        "format": "saelens",
        "d_in": D_IN,
        "d_sae": 96,
        "width": 96,
        "activation": "relu",
        "topk_k": None,
        "trained_on": "my-llama",
        "trained_layer": 2,
        "hook_name": "blocks.2.hook_resid_post",
        "status": "ready",
        "download_progress": None,
        "attached_layers": [],
    }
    # encoder + decoder + both biases, float32
    assert sae["memory_usage_mb"] == round(4 * (2 * D_IN * 96 + 96 + D_IN) / 2**20, 3)
    row = SAE.objects.get(pk=sae["id"])
    assert (row.local_path, row.repository_id, row.format, row.d_in, row.d_sae, row.trained_on_layer, row.status) == (
        str(folder),
        "",
        "saelens",
        D_IN,
        96,
        2,
        "ready",
    )
    assert not Job.objects.exists()  # nothing to download
    listed = ok(api.get("/api/saes"))
    assert [s["id"] for s in listed["saes"]] == [row.id] and listed["total"] == 1
    assert ok(api.get(f"/api/saes/{row.id}"))["source"] == "local"


def test_a_gemma_scope_file_takes_the_hints_its_files_lack(api, tmp_path):
    folder = write_gemmascope(tmp_path / "scope" / "w48")
    data = ok(register(api, local_path=str(folder), trained_on="tiny-llama", trained_layer=2), 201)["sae"]
    assert (data["format"], data["activation"], data["d_in"], data["d_sae"]) == ("gemmascope", "jumprelu", D_IN, 48)
    assert (data["name"], data["trained_on"], data["trained_layer"]) == ("w48", "tiny-llama", 2)
    # the layout's threshold adds one float per feature
    assert data["memory_usage_mb"] == round(4 * (2 * D_IN * 48 + 48 + D_IN + 48) / 2**20, 3)


def test_a_params_npz_named_directly_is_its_directory(api, tmp_path):
    folder = write_gemmascope(tmp_path / "scope" / "w48")
    data = ok(register(api, local_path=str(folder / "params.npz")), 201)["sae"]
    assert (data["local_path"], data["name"], data["format"]) == (str(folder), "w48", "gemmascope")
    assert refused(register(api, local_path=str(folder)), 409, "SAE_ALREADY_EXISTS")["details"]["sae_id"] == data["id"]


def test_what_the_files_say_wins_over_the_hints(api, tmp_path):
    folder = write_saelens(tmp_path / "own", hook_layer=3)
    data = ok(register(api, local_path=str(folder), trained_on="other", trained_layer=0), 201)["sae"]
    assert (data["trained_on"], data["trained_layer"]) == ("my-llama", 3)


def test_refusals_create_nothing(api, tmp_path, tiny_assets):
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "cfg.json").write_text(json.dumps({"d_in": D_IN, "d_sae": 8}))
    (corrupt / "sae_weights.safetensors").write_bytes(b"not a safetensors file")
    wrong_shapes = write_saelens(tmp_path / "wrong", d_sae=8)
    cfg = json.loads((wrong_shapes / "cfg.json").read_text())
    (wrong_shapes / "cfg.json").write_text(json.dumps({**cfg, "d_sae": 9}))
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("hello")
    cases = [
        (str(tmp_path / "missing"), "INVALID_LOCAL_PATH", "does not exist"),
        ("relative/sae", "INVALID_LOCAL_PATH", "absolute"),
        # outside LOCAL_MODEL_ROOTS (the test roots: the temporary and asset folders)
        ("/etc", "INVALID_LOCAL_PATH", "LOCAL_MODEL_ROOTS"),
        ("/usr/lib/python3", "INVALID_LOCAL_PATH", "LOCAL_MODEL_ROOTS"),
        (f"{tmp_path}/{'x' * 300}", "INVALID_LOCAL_PATH", "File name too long"),
        (str(empty), "SAE_INVALID", "No known SAE layout"),
        (str(not_a_dir), "SAE_INVALID", "No known SAE layout"),
        (str(tiny_assets.models["tiny-llama"].path), "SAE_INVALID", "No known SAE layout"),
        (str(corrupt), "SAE_INVALID", "Corrupt SAE weights"),
        (str(wrong_shapes), "SAE_INVALID", "not a readable SAE"),
    ]
    for path, code, words in cases:
        error = refused(register(api, local_path=path), 400, code)
        assert words in error["message"], (path, error)
        assert error["details"]["local_path"], path
    for body in (
        {"source": "local"},
        {"source": "local", "local_path": ""},
        {"source": "local", "local_path": str(empty), "trained_layer": -1},
        {"source": "elsewhere", "local_path": str(empty)},
    ):
        refused(api.post("/api/saes", body, format="json"), 422, "VALIDATION_ERROR")
    assert not SAE.objects.exists() and not Job.objects.exists()


def test_the_same_files_are_registered_once(api, tmp_path):
    folder = write_saelens(tmp_path / "mine")
    first = ok(register(api, local_path=str(folder)), 201)["sae_id"]
    for spelling in (
        str(folder),
        f"{folder}/",
        str(tmp_path / "." / "mine"),
        str(folder / "sae_weights.safetensors"),
        str(folder / "cfg.json"),
    ):
        error = refused(register(api, local_path=spelling, name="again"), 409, "SAE_ALREADY_EXISTS")
        assert error["details"]["sae_id"] == first
    link = tmp_path / "link-to-mine"
    link.symlink_to(folder)
    assert refused(register(api, local_path=str(link)), 409, "SAE_ALREADY_EXISTS")["details"]["sae_id"] == first
    assert list(SAE.objects.values_list("id", flat=True)) == [first]
    # once deleted, the same files can be registered again
    ok(api.delete(f"/api/saes/{first}"))
    assert ok(register(api, local_path=str(folder)), 201)["sae_id"] != first


def test_the_hub_source_is_the_download_route(api, hub):
    from tests.api.conftest import NPZ_PATH, SAE_REPO

    data = ok(api.post("/api/saes", {"repository_id": SAE_REPO, "file_path": NPZ_PATH}, format="json"), 202)
    assert data["status"] == "downloading" and data["job"]["kind"] == "sae_download"
    assert data["sae"]["source"] == "huggingface"
    refused(api.post("/api/saes", {"source": "huggingface"}, format="json"), 422, "VALIDATION_ERROR")


# --- delete keeps the user's files ----------------------------------------------------------


def test_delete_keeps_the_files(api, tmp_path, settings):
    outside = write_saelens(tmp_path / "research" / "sae-a")
    # even a directory that happens to lie inside SAE_CACHE_DIR is the user's own
    settings.SAE_CACHE_DIR = str(tmp_path / "sae_cache")
    inside = write_saelens(tmp_path / "sae_cache" / "mine" / "sae-b", seed=3)
    for folder in (outside, inside):
        before = fingerprint(folder)
        sae_id = ok(register(api, local_path=str(folder)), 201)["sae_id"]
        with TestCase.captureOnCommitCallbacks(execute=True):
            deleted = ok(api.delete(f"/api/saes/{sae_id}"))
        assert deleted == {"status": "deleted", "id": sae_id, "freed_disk_mb": None}
        assert not SAE.objects.filter(pk=sae_id).exists()
        assert fingerprint(folder) == before


# --- attach end to end ----------------------------------------------------------------------


def _generate(engine_client, steering=None) -> str:
    from gpu_engine.api.protocol import GenerationJob, SamplingParams

    handle = engine_client.generate(
        GenerationJob(
            request_id=f"r-{os.urandom(4).hex()}",
            prompt="the sea and the sky",
            steering=steering,
            sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        )
    )
    events = list(handle.events(timeout_s=60))
    return events[-1].text


def test_a_registered_sae_attaches_and_steers(api, engine_client, tiny_llama, tmp_path):
    from gpu_engine.api.protocol import SteeringSpec

    folder = write_saelens(tmp_path / "trained" / "resid-sae", hook_layer=1)
    before = fingerprint(folder)
    sae_id = ok(register(api, local_path=str(folder)), 201)["sae_id"]
    load = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, load["job"]["id"]) == "succeeded"
    compat = ok(api.get(f"/api/saes/{sae_id}/compatibility", {"layer": 1}))
    assert (compat["compatible"], compat["errors"]) == (True, [])

    attached = ok(api.post(f"/api/saes/{sae_id}/attach", {"layer": 1}, format="json"))
    assert (attached["status"], attached["sae_id"], attached["layer"], attached["layer_module_path"]) == (
        "attached",
        sae_id,
        1,
        "model.layers.1",
    )
    assert Attachment.objects.get().sae_id == sae_id
    assert ok(api.get(f"/api/saes/{sae_id}"))["status"] == "attached"
    assert [(a.sae_id, a.layer) for a in engine_client.attachments()] == [(sae_id, 1)]

    plain = _generate(engine_client)
    unsteered = _generate(engine_client, SteeringSpec.from_mapping({(sae_id, 1): {}}))
    steered = _generate(engine_client, SteeringSpec.from_mapping({(sae_id, 1): {5: 40.0}}))
    assert unsteered == plain  # attaching alone changes nothing
    assert steered != plain  # positive control: the user's decoder direction steers
    status = ok(api.get("/api/saes/attachment"))
    assert status["sae_id"] == sae_id and status["steering_apply_count"] > 0

    refused(api.delete(f"/api/saes/{sae_id}"), 409, "SAE_ALREADY_ATTACHED")
    ok(api.post(f"/api/saes/{sae_id}/detach", {}, format="json"))
    with TestCase.captureOnCommitCallbacks(execute=True):
        ok(api.delete(f"/api/saes/{sae_id}"))
    assert fingerprint(folder) == before


# --- manage.py register_sae -----------------------------------------------------------------


def test_register_sae_command_prints_the_id(tmp_path):
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    folder = write_gemmascope(tmp_path / "scope-cli")
    out, err = StringIO(), StringIO()
    call_command(
        "register_sae", str(folder), "--name", "cli", "--model", "tiny-llama", "--layer", "3", stdout=out, stderr=err
    )
    row = SAE.objects.get()
    assert out.getvalue() == f"{row.id}\n"  # the id alone: SAE=$(manage.py register_sae …)
    assert (
        row.name,
        row.local_path,
        row.format,
        row.d_in,
        row.d_sae,
        row.trained_on_model,
        row.trained_on_layer,
        row.status,
    ) == ("cli", str(folder), "gemmascope", D_IN, 48, "tiny-llama", 3, "ready")
    assert f"from {folder}" in err.getvalue()
    for path, code in (
        (str(folder), "SAE_ALREADY_EXISTS"),
        ("/etc", "INVALID_LOCAL_PATH"),
        (str(tmp_path), "SAE_INVALID"),
    ):
        with pytest.raises(CommandError, match=code):
            call_command("register_sae", path, stdout=StringIO(), stderr=StringIO())
    assert SAE.objects.count() == 1


def test_register_sae_command_exit_status(run_manage, tmp_path):
    env = {"MILLM_DATA_DIR": str(tmp_path / "data"), "LOCAL_MODEL_ROOTS": str(tmp_path)}
    bad = run_manage("register_sae", str(tmp_path / "nowhere"), env=env)
    assert bad.returncode == 1 and bad.stdout == ""
    assert "INVALID_LOCAL_PATH" in bad.stderr and "does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr
    not_sae = run_manage("register_sae", str(tmp_path), env=env)
    assert not_sae.returncode == 1 and "SAE_INVALID" in not_sae.stderr
    # a fresh SQLite database: migrate, register, and read it back in another process
    assert run_manage("migrate", "--no-input", env=env).returncode == 0
    folder = write_saelens(tmp_path / "cli-sae")
    good = run_manage("register_sae", str(folder), env=env)
    assert good.returncode == 0, good.stderr
    sae_id = good.stdout.strip()
    assert sae_id.startswith("sae_")
    shell = run_manage(
        "shell",
        "-v",
        "0",
        "-c",
        "from registry.models import SAE; s = SAE.objects.get(); "
        "print(s.id, s.format, s.d_in, s.d_sae, s.trained_on_layer)",
        env=env,
    )
    assert shell.stdout.split() == [sae_id, "saelens", str(D_IN), "96", "1"]


# --- admin -------------------------------------------------------------------------------


def test_admin_add_form_registers_through_the_service(staff_client, tmp_path):
    page = staff_client.get("/admin/registry/sae/add/").content.decode()
    assert 'name="local_path"' in page and 'name="d_in"' not in page
    folder = write_saelens(tmp_path / "admin-sae", d_sae=32, hook_layer=3)
    response = staff_client.post(
        "/admin/registry/sae/add/",
        {"local_path": str(folder), "name": "from admin", "trained_on_model": "", "trained_on_layer": ""},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    row = SAE.objects.get()
    assert (
        row.name,
        row.local_path,
        row.format,
        row.d_in,
        row.d_sae,
        row.hook_name,
        row.trained_on_layer,
        row.status,
    ) == ("from admin", str(folder), "saelens", D_IN, 32, "blocks.3.hook_resid_post", 3, "ready")
    # where the files are is not editable afterwards
    change = staff_client.get(admin_url(row)).content.decode()
    assert str(folder) in change and 'name="local_path"' not in change
    assert "local" in staff_client.get("/admin/registry/sae/").content.decode()


def test_admin_add_form_shows_the_refusal(staff_client, tmp_path):
    folder = write_saelens(tmp_path / "twice")
    for path, code in ((str(tmp_path / "nope"), "INVALID_LOCAL_PATH"), (str(tmp_path), "SAE_INVALID")):
        response = staff_client.post("/admin/registry/sae/add/", {"local_path": path})
        assert response.status_code == 200 and code in response.content.decode()
    assert not SAE.objects.exists()
    staff_client.post("/admin/registry/sae/add/", {"local_path": str(folder)})
    response = staff_client.post("/admin/registry/sae/add/", {"local_path": str(folder)})
    assert "SAE_ALREADY_EXISTS" in response.content.decode()
    assert SAE.objects.count() == 1


def test_admin_delete_keeps_the_files(staff_client, tmp_path):
    folder = write_saelens(tmp_path / "kept")
    before = fingerprint(folder)
    staff_client.post("/admin/registry/sae/add/", {"local_path": str(folder)})
    row = SAE.objects.get()
    with TestCase.captureOnCommitCallbacks(execute=True):
        staff_client.post("/admin/registry/sae/", {"action": "delete_saes", "_selected_action": [row.pk]})
    assert not SAE.objects.exists() and fingerprint(folder) == before
