"""Settings that hold whatever the path (issue 37, part 6): SPECULATIVE_MODEL names a
registered model by name or repository id and is checked at start-up and before a swap;
AUTO_LOAD_MODEL wins over a restored model unless that one is held, and readiness says
why when it does not apply; a backend that cannot read a model's format is refused at
registration, nothing stored."""

from __future__ import annotations

import pytest

from core.errors import UnsupportedModel
from registry.errors import ModelNotFound
from registry.models import Job, Model
from tests.api.conftest import ok, refused

pytestmark = pytest.mark.django_db

UNREGISTERED = "millm-test/no-such-draft"


def _draft(tiny_assets) -> Model:
    """A registered draft known on the hub as ``millm-test/tiny-draft``."""
    return Model.objects.create(
        name="tiny-draft",
        source=Model.Source.HUGGINGFACE,
        repo_id="millm-test/tiny-draft",
        local_path=str(tiny_assets.models["tiny-gpt2"].path),
    )


# --- SPECULATIVE_MODEL --------------------------------------------------------------------


def test_speculative_model_by_name_or_repository_id_is_the_drafts_files(settings, tiny_llama, tiny_assets):
    from orchestration.load_checks import load_job

    draft = _draft(tiny_assets)
    settings.MILLM_BACKEND = "transformers"
    for value in ("tiny-draft", "millm-test/tiny-draft"):
        settings.SPECULATIVE_MODEL = value
        job = load_job(tiny_llama, device="cpu", dtype="float32")
        assert job.options["speculative_model"] == draft.local_path
    settings.SPECULATIVE_MODEL = "self:layers=1"
    assert load_job(tiny_llama, device="cpu", dtype="float32").options["speculative_model"] == "self:layers=1"


def test_start_up_refuses_a_speculative_model_that_names_nothing(settings, monkeypatch, tiny_assets):
    from orchestration import startup

    settings.EMBEDDED = False
    settings.SPECULATIVE_MODEL = UNREGISTERED
    monkeypatch.setattr(startup, "_started", False)
    with pytest.raises(ModelNotFound) as caught:
        startup.application_start(auto_load_model=False)
    assert caught.value.details == {"setting": "SPECULATIVE_MODEL", "value": UNREGISTERED}
    assert "SPECULATIVE_MODEL" in caught.value.message
    # registered under that repository id, the same start passes, even while its files
    # are still downloading (a load is refused until they are there)
    draft = _draft(tiny_assets)
    settings.SPECULATIVE_MODEL = "millm-test/tiny-draft"
    monkeypatch.setattr(startup, "_started", False)
    startup.application_start(auto_load_model=False)
    Model.objects.filter(pk=draft.pk).update(local_path="", status=Model.Status.DOWNLOADING)
    monkeypatch.setattr(startup, "_started", False)
    startup.application_start(auto_load_model=False)
    from orchestration.load_checks import speculative_draft
    from registry.errors import ModelInvalid

    with pytest.raises(ModelInvalid, match="no files yet"):
        speculative_draft("millm-test/tiny-draft")


def test_a_load_with_an_unknown_draft_is_refused_before_the_resident_model_goes(
    api, engine_client, settings, tiny_llama, tiny_assets
):
    from orchestration import services as orchestration_services
    from registry import services

    settings.MILLM_BACKEND = "transformers"
    orchestration_services.model_load(model=tiny_llama)
    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    settings.SPECULATIVE_MODEL = UNREGISTERED
    error = refused(api.post(f"/api/models/{gpt2.pk}/load"), 404, "MODEL_NOT_FOUND")
    assert error["details"]["setting"] == "SPECULATIVE_MODEL"
    assert engine_client.status().model_id == "tiny-llama"
    assert not Job.objects.filter(kind="model_load", model=gpt2).exists()


# --- AUTO_LOAD_MODEL after a restart -------------------------------------------------------


def _restored(model, *, locked: bool) -> None:
    """The rows a restart's restore leaves: ``model`` resident."""
    from orchestration import services as orchestration_services

    orchestration_services.model_load(model=model)
    Model.objects.filter(pk=model.pk).update(locked=locked)


def test_auto_load_model_replaces_a_restored_model_that_nothing_holds(engine_client, settings, tiny_llama, tiny_assets):
    from orchestration.startup import auto_load
    from registry import services

    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    _restored(tiny_llama, locked=False)
    settings.AUTO_LOAD_MODEL = "tiny-gpt2"
    settings.AUTO_ATTACH_SAES = []
    job = auto_load()
    assert job is not None and job.model_id == gpt2.pk and job.kind == "model_load"


def test_readiness_says_why_a_held_restored_model_keeps_the_engine(
    api, engine_client, settings, tiny_llama, tiny_assets
):
    from orchestration.startup import auto_load
    from registry import services

    services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    _restored(tiny_llama, locked=True)
    settings.AUTO_LOAD_MODEL = "tiny-gpt2"
    settings.AUTO_ATTACH_SAES = []
    assert auto_load() is None
    data = ok(api.get("/api/health/ready"))
    state = data["auto_load_model"]
    assert (state["configured"], state["resident"], state["applied"]) == ("tiny-gpt2", "tiny-llama", False)
    assert "locked" in state["reason"] and "tiny-llama" in state["reason"]
    # the configured model resident: applied, no reason
    Model.objects.filter(pk=tiny_llama.pk).update(locked=False)
    settings.AUTO_LOAD_MODEL = "tiny-llama"
    assert ok(api.get("/api/health/ready"))["auto_load_model"] == {
        "configured": "tiny-llama",
        "resident": "tiny-llama",
        "applied": True,
    }


# --- backend and format at registration ---------------------------------------------------


def test_a_backend_that_cannot_read_the_format_is_refused_at_registration(api, tiny_llama, tiny_assets):
    before = Model.objects.count()
    path = str(tiny_assets.models["tiny-gpt2"].path)
    body = {"source": "local", "local_path": path, "custom_name": "gpt2-on-llamacpp", "backend": "llamacpp"}
    error = refused(api.post("/api/models", body, format="json"), 400, "UNSUPPORTED_MODEL")
    assert error["details"]["field"] == "backend" and error["details"]["backend"] == "llamacpp"
    assert Model.objects.count() == before
    # a PATCH of the backend: the same refusal, the row unchanged
    error = refused(
        api.patch(f"/api/models/{tiny_llama.pk}", {"backend": "llamacpp"}, format="json"), 400, "UNSUPPORTED_MODEL"
    )
    assert error["details"]["field"] == "backend"
    assert Model.objects.get(pk=tiny_llama.pk).backend == ""
    # load_model --backend goes through the same service
    from registry import services

    with pytest.raises(UnsupportedModel):
        services.model_set_backend(model=tiny_llama, backend="llamacpp")


@pytest.mark.parametrize("backend", ["vllm", "transformers"])
def test_a_gguf_file_on_another_backend_is_refused_at_registration(api, tiny_gguf, backend):
    body = {"source": "local", "local_path": str(tiny_gguf), "backend": backend}
    error = refused(api.post("/api/models", body, format="json"), 400, "UNSUPPORTED_MODEL")
    assert error["details"]["fields"]["backend"] and error["details"]["format"] == "gguf"
    assert not Model.objects.exists()


def test_a_gguf_download_for_another_backend_stores_nothing(api, hub, tiny_gguf):
    from tests.api.standin_hub import Repo

    repo = "millm-test/tiny-gguf-backend"
    hub.add_repo(Repo(repo, {"tiny-llama.F32.gguf": tiny_gguf.read_bytes(), "README.md": b"# gguf\n"}))
    try:
        body = {"source": "huggingface", "repo_id": f"{repo}:F32", "backend": "vllm"}
        error = refused(api.post("/api/models", body, format="json"), 400, "UNSUPPORTED_MODEL")
        assert error["details"]["field"] == "backend"
        assert not Model.objects.exists() and not Job.objects.exists()
    finally:
        hub.repos.pop(repo, None)
