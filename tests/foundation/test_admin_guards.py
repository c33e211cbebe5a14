"""Admin pages that must refuse rather than break or drift: the object's own delete page
for a row a service will not delete, and the edit and add forms of a model, which must
not say what the engine does not hold nor take what the API's registration refuses."""

from __future__ import annotations

import os
import tempfile

import pytest
from django.contrib.admin.models import DELETION, LogEntry

from registry import services
from tests.admin_urls import admin_url
from registry.models import SAE, Model

pytestmark = pytest.mark.django_db


@pytest.fixture
def model(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    return services.model_register_local(local_path=str(asset.path), name=asset.name)


@pytest.fixture
def sae(tiny_assets):
    asset = next(iter(tiny_assets.saes.values()))
    return services.sae_register_local(local_path=str(asset.path), name=asset.name)


def _messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# --- the delete page -------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, code",
    [
        ({"locked": True}, "MODEL_LOCKED"),
        ({"status": "loaded"}, "MODEL_LOADED"),
        ({"status": "loading"}, "MODEL_LOADED"),
    ],
)
def test_delete_page_refuses_a_locked_or_resident_model(staff_client, model, state, code):
    Model.objects.filter(pk=model.pk).update(**state)
    url = admin_url(model, "delete")
    assert staff_client.get(url).status_code == 200  # the confirmation page
    response = staff_client.post(url, {"post": "yes"}, follow=True)
    assert response.status_code == 200
    # back on the model's own page, with the refusal the bulk action gives
    assert response.redirect_chain[-1][0] == admin_url(model)
    [message] = _messages(response)
    assert message.startswith("tiny-llama: Model 'tiny-llama' is ") and f"({code})" in message
    # the admin capitalises the first letter of a message
    assert message[0].upper() + message[1:] in response.content.decode().replace("&#x27;", "'")
    assert Model.objects.filter(pk=model.pk).exists()
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()


@pytest.mark.parametrize("key", [None, "sae_22119edf9d58c3fc", "sae_5F3A2f"])
def test_delete_page_refuses_an_attached_sae(staff_client, sae, key):
    # a key holding one of the admin's escapes (``_22`` reads back as ``"``) is refused and
    # shown on its own page like any other
    if key is not None:
        SAE.objects.filter(pk=sae.pk).update(id=key)
        sae = SAE.objects.get(pk=key)
    SAE.objects.filter(pk=sae.pk).update(status=SAE.Status.ATTACHED)
    response = staff_client.post(admin_url(sae, "delete"), {"post": "yes"}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain[-1][0] == admin_url(sae)
    [message] = _messages(response)
    assert "is attached; detach it first (SAE_ALREADY_ATTACHED)" in message
    assert SAE.objects.filter(pk=sae.pk).exists()


def test_delete_page_still_deletes_what_may_go(staff_client, model):
    response = staff_client.post(admin_url(model, "delete"), {"post": "yes"}, follow=True)
    assert response.status_code == 200
    assert any("was deleted successfully" in m for m in _messages(response))
    assert not Model.objects.filter(pk=model.pk).exists()
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 1


# --- editing a model ---------------------------------------------------------------------

ENGINE_INPUTS = ("name", "quantization", "trust_remote_code", "backend")
IDENTITY_INPUTS = ("source", "repo_id", "revision", "local_path", "format", "gguf_file")


def _inputs(page: str) -> set[str]:
    return {name for name in (*ENGINE_INPUTS, *IDENTITY_INPUTS) if f'name="{name}"' in page}


@pytest.mark.parametrize("status", ["loaded", "loading", "unloading"])
def test_a_resident_model_cannot_be_edited_away_from_what_the_engine_holds(staff_client, model, status):
    Model.objects.filter(pk=model.pk).update(status=status)
    before = Model.objects.values().get(pk=model.pk)
    url = admin_url(model)
    page = staff_client.get(url).content.decode()
    assert _inputs(page) == set()
    assert before["local_path"] in page  # shown, not editable
    response = staff_client.post(
        url,
        {
            "name": "renamed",
            "quantization": "Q8",
            "local_path": "/nonexistent",
            "backend": "llamacpp",
            "trust_remote_code": "on",
            "_save": "Save",
        },
    )
    assert response.status_code == 302
    after = Model.objects.values().get(pk=model.pk)
    assert {k: after[k] for k in (*ENGINE_INPUTS, *IDENTITY_INPUTS, "status")} == {
        k: before[k] for k in (*ENGINE_INPUTS, *IDENTITY_INPUTS, "status")
    }


def test_a_ready_model_keeps_its_files_and_changes_its_settings(staff_client, model):
    url = admin_url(model)
    assert _inputs(staff_client.get(url).content.decode()) == set(ENGINE_INPUTS)
    response = staff_client.post(
        url, {"name": "renamed", "quantization": "Q8", "local_path": "/nonexistent", "backend": "", "_save": "Save"}
    )
    assert response.status_code == 302
    row = Model.objects.get(pk=model.pk)
    assert (row.name, row.quantization, row.local_path, row.status) == ("renamed", "Q8", model.local_path, "ready")


def test_a_backend_that_cannot_read_the_models_format_is_refused_on_its_page(staff_client, model):
    url = admin_url(model)
    response = staff_client.post(
        url, {"name": model.name, "quantization": model.quantization, "backend": "llamacpp", "_save": "Save"}
    )
    assert response.status_code == 200  # the form again, with the refusal on the field
    assert "the llamacpp backend loads GGUF models only (UNSUPPORTED_MODEL)" in response.content.decode()
    assert Model.objects.get(pk=model.pk).backend == ""


# --- adding a model ----------------------------------------------------------------------


def _form_errors(response) -> str:
    return " ".join(str(e) for errors in response.context["adminform"].form.errors.values() for e in errors)


def test_add_model_registers_a_local_checkpoint_through_the_service(staff_client, tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    page = staff_client.get("/admin/registry/model/add/").content.decode()
    assert 'name="local_path"' in page and 'name="source"' not in page
    response = staff_client.post(
        "/admin/registry/model/add/",
        {"local_path": str(asset.path), "name": "from admin", "quantization": "FP32", "backend": "", "_save": "Save"},
    )
    assert response.status_code == 302, _form_errors(response)
    row = Model.objects.get(name="from admin")
    assert (row.source, row.local_path, row.format, row.status) == (
        "local",
        str(asset.path.resolve()),
        "transformers",
        "ready",
    )
    assert row.num_layers and row.hidden_size  # read from the checkpoint, as the API does


_MISSING = os.path.join(tempfile.gettempdir(), "millm-no-such-folder")


@pytest.mark.parametrize(
    "path, message",
    [
        # under LOCAL_MODEL_ROOTS (the tests' roots include the temp directory) but missing
        (_MISSING, f"{_MISSING} does not exist (INVALID_LOCAL_PATH)"),
        # outside the roots: one answer, whether it exists or not
        (
            "/nonexistent/folder",
            "local_path must lie under one of the directories of LOCAL_MODEL_ROOTS (INVALID_LOCAL_PATH)",
        ),
        ("/etc", "local_path must lie under one of the directories of LOCAL_MODEL_ROOTS (INVALID_LOCAL_PATH)"),
        ("relative/folder", "local_path must be an absolute path (INVALID_LOCAL_PATH)"),
    ],
)
def test_add_model_refuses_a_path_the_api_refuses(staff_client, path, message):
    response = staff_client.post(
        "/admin/registry/model/add/", {"local_path": path, "name": "ghost", "quantization": "FP32", "_save": "Save"}
    )
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["local_path"] == [message]
    assert not Model.objects.exists()


def test_add_model_refuses_a_taken_name_and_a_hub_row_without_files(staff_client, model, tiny_assets, tmp_path):
    import shutil

    asset = tiny_assets.models["tiny-llama"]
    # a copy elsewhere under the name the registered checkpoint already has
    copy = tmp_path / "tiny-llama"
    shutil.copytree(asset.path, copy)
    response = staff_client.post(
        "/admin/registry/model/add/", {"local_path": str(copy), "quantization": "FP32", "_save": "Save"}
    )
    assert response.context["adminform"].form.errors["name"] == [
        "A model named 'tiny-llama' is already registered (MODEL_ALREADY_EXISTS)"
    ]
    # the registered checkpoint itself, under any name, is the same registration again
    response = staff_client.post(
        "/admin/registry/model/add/",
        {"local_path": str(asset.path), "name": "again", "quantization": "FP32", "_save": "Save"},
    )
    errors = response.context["adminform"].form.errors
    assert any(
        "is already registered as model 'tiny-llama'" in message for messages in errors.values() for message in messages
    ), errors
    # the hub has no add form here (it would make a row with no files): a source field
    # posted anyway is ignored and the missing path is the form's error, not the database's
    response = staff_client.post(
        "/admin/registry/model/add/",
        {"source": "huggingface", "repo_id": "", "name": "hub", "quantization": "FP32", "_save": "Save"},
    )
    assert response.status_code == 200
    assert response.context["adminform"].form.errors["local_path"] == ["This field is required."]
    assert list(Model.objects.values_list("name", flat=True)) == ["tiny-llama"]
