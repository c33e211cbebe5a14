"""The model-level backend choice: the record's field (admin, /api/models, load_model
--backend), MILLM_BACKEND as its default, refusals, and where the active backend shows
(/api/health/inference, X-miLLM-Backend)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.test import Client

from gpu_engine.api import backends
from gpu_engine.backends import BackendEntry
from orchestration import services as orchestration_services
from registry.models import Job, Model
from tests.api.conftest import ok, refused

pytestmark = pytest.mark.django_db


@pytest.fixture
def absent_backend(monkeypatch):
    """A registered backend whose package is not installed here."""
    entry = BackendEntry(
        name="absent",
        summary="test",
        requires=("no_such_package_xyz",),
        install="scripts/setup absent",
        loader="no_such_package_xyz:load",
    )
    monkeypatch.setitem(backends._BACKENDS, "absent", entry)
    return entry


def test_the_backend_field_follows_millm_backend_until_set(api, tiny_llama, settings):
    detail = ok(api.get(f"/api/models/{tiny_llama.id}"))
    assert (detail["backend"], detail["effective_backend"]) == (None, "transformers")
    ok(api.patch(f"/api/models/{tiny_llama.id}", {"backend": "transformers"}, format="json"))
    assert Model.objects.get(pk=tiny_llama.id).backend == "transformers"
    ok(api.patch(f"/api/models/{tiny_llama.id}", {"backend": ""}, format="json"))
    assert Model.objects.get(pk=tiny_llama.id).backend == ""


def test_a_patch_naming_a_field_it_cannot_change_is_refused(api, tiny_llama):
    error = refused(
        api.patch(f"/api/models/{tiny_llama.id}", {"backend": "transformers", "quantization": "Q8"}, format="json"),
        422,
        "VALIDATION_ERROR",
    )
    assert list(error["details"]["fields"]) == ["quantization"]
    row = Model.objects.get(pk=tiny_llama.id)
    assert (row.backend, row.quantization) == ("", "FP32")  # nothing half-applied


def test_an_unknown_backend_is_refused_everywhere(api, tiny_llama, tiny_assets):
    error = refused(
        api.patch(f"/api/models/{tiny_llama.id}", {"backend": "nope"}, format="json"), 422, "VALIDATION_ERROR"
    )
    assert "'nope'" in error["details"]["fields"]["backend"][0]
    assert "transformers" in error["details"]["known"]
    assert Model.objects.get(pk=tiny_llama.id).backend == ""
    path = tiny_assets.models["tiny-gpt2"].path
    refused(
        api.post(
            "/api/models",
            {"source": "local", "local_path": str(path), "custom_name": "g", "backend": "nope"},
            format="json",
        ),
        422,
        "VALIDATION_ERROR",
    )
    assert not Model.objects.filter(name="g").exists()


def test_register_with_a_backend(api, tiny_assets):
    path = tiny_assets.models["tiny-gpt2"].path
    data = ok(
        api.post(
            "/api/models",
            {"source": "local", "local_path": str(path), "custom_name": "g", "backend": "transformers"},
            format="json",
        ),
        201,
    )
    assert data["model"]["backend"] == "transformers"


def test_the_backend_cannot_change_under_a_resident_model(api, engine_client, tiny_llama):
    orchestration_services.model_load(model=tiny_llama)
    refused(api.patch(f"/api/models/{tiny_llama.id}", {"backend": "transformers"}, format="json"), 409, "MODEL_LOADED")


def test_a_load_on_an_uninstalled_backend_is_a_400_with_the_install_command(
    api, engine_client, tiny_llama, absent_backend, settings
):
    ok(api.patch(f"/api/models/{tiny_llama.id}", {"backend": "absent"}, format="json"))
    error = refused(api.post(f"/api/models/{tiny_llama.id}/load"), 400, "BACKEND_UNAVAILABLE")
    assert error["details"]["install"] == "scripts/setup absent"
    assert "scripts/setup absent" in error["message"]
    assert not Job.objects.filter(kind="model_load").exists()
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    # MILLM_BACKEND is the default of a model without its own choice
    ok(api.patch(f"/api/models/{tiny_llama.id}", {"backend": ""}, format="json"))
    settings.MILLM_BACKEND = "absent"
    refused(api.post(f"/api/models/{tiny_llama.id}/load"), 400, "BACKEND_UNAVAILABLE")
    settings.MILLM_BACKEND = "transformers"
    ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)


def test_health_lists_the_backends_with_their_install_commands(api, engine_client, absent_backend):
    data = ok(api.get("/api/health/inference"))
    listed = {b["name"]: b for b in data["backends"]}
    assert listed["transformers"]["available"] is True
    assert listed["absent"] == {
        "name": "absent",
        "summary": "test",
        "available": False,
        "missing": ["no_such_package_xyz"],
        "install": "scripts/setup absent",
        "options": [],
        "quantizations": {},
    }


def test_load_model_backend_keeps_the_choice(settings, engine_client, tiny_llama, absent_backend, capsys):
    from django.core.management.base import CommandError

    settings.EMBEDDED = False  # as in distributed mode, where run_engine is reachable
    with pytest.raises(CommandError, match="BACKEND_UNAVAILABLE"):
        call_command("load_model", "tiny-llama", "--backend", "absent")
    assert Model.objects.get(pk=tiny_llama.id).backend == "absent"
    with pytest.raises(CommandError, match="VALIDATION_ERROR"):
        call_command("load_model", "tiny-llama", "--backend", "nope")
    call_command("load_model", "tiny-llama", "--backend", "transformers")
    assert "transformers backend" in capsys.readouterr().out
    assert Model.objects.get(pk=tiny_llama.id).backend == "transformers"
    assert engine_client.status().backend == "transformers"


def test_the_admin_sets_the_backend_and_refuses_unknown_ones(admin_client: Client, tiny_llama):
    url = f"/admin/registry/model/{tiny_llama.id}/change/"
    page = admin_client.get(url)
    assert b'name="backend"' in page.content
    form = {
        "name": tiny_llama.name,
        "source": tiny_llama.source,
        "revision": "main",
        "local_path": tiny_llama.local_path,
        "format": tiny_llama.format,
        "quantization": tiny_llama.quantization,
        "backend": "nope",
    }
    response = admin_client.post(url, form)
    assert response.status_code == 200 and b"unknown backend" in response.content
    assert Model.objects.get(pk=tiny_llama.id).backend == ""
    response = admin_client.post(url, {**form, "backend": "transformers"})
    assert response.status_code == 302
    assert Model.objects.get(pk=tiny_llama.id).backend == "transformers"
    listing = admin_client.get("/admin/registry/model/")
    assert b"transformers" in listing.content


def test_a_vllm_model_is_loaded_with_the_vllm_settings_as_its_options(tiny_llama, settings):
    tiny_llama.backend = "vllm"
    settings.VLLM_DISTRIBUTED_EXECUTOR = "uni"
    settings.VLLM_MAX_NUM_SEQS = 8
    job = orchestration_services.load_job(tiny_llama, device="cpu", dtype="float32")
    assert job.backend == "vllm"
    assert job.options == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "distributed_executor_backend": "uni",
        "gpu_memory_utilization": 0.9,
        "max_model_len": 0,
        "max_num_seqs": 8,
        "enforce_eager": True,
    }


def test_a_gguf_model_is_loaded_with_the_gguf_settings_as_its_options(tiny_llama, settings):
    tiny_llama.backend = "llamacpp"
    settings.GGUF_STEERING_MODE = "control_vector_swap"
    settings.GGUF_CONTEXT_LENGTH = 256
    job = orchestration_services.load_job(tiny_llama, device="cpu", dtype="float32")
    assert job.backend == "llamacpp"
    assert job.options == {
        "context_length": 256,
        "kv_cache_type": "q8_0",
        "flash_attention": True,
        "tensor_split": [],
        "enable_embeddings": True,
        "steering_mode": "control_vector_swap",
        "prefix_cache_max_mb": 256,
    }
