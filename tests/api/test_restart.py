"""What an embedded start-up does to the rows a previous process left: reconcile what was
mid-way, then restore what was resident into the new (empty) engine, or record on the rows
why it could not. The real-process version (daphne killed and started again) is
tests/distributed/test_embedded_restart.py."""

from __future__ import annotations

import pytest

from orchestration.restore import restore_recorded_state
from registry.maintenance import startup_reconcile
from registry.models import SAE, Attachment, Job, Model

pytestmark = pytest.mark.django_db


class Attempts:
    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.ended = False

    def begin(self) -> int:
        self.count += 1
        return self.count

    def end(self) -> None:
        self.ended = True


def _recorded(model, sae, layer: int = 1) -> None:
    """The rows a server leaves when it dies with ``model`` loaded and ``sae`` attached."""
    Model.objects.filter(pk=model.pk).update(status="loaded", locked=True, device="cpu", dtype="float32")
    Attachment.objects.create(model=model, sae=sae, layer=layer, layer_module_path=f"model.layers.{layer}")
    SAE.objects.filter(pk=sae.pk).update(status="attached")


def test_reconcile_keeps_what_was_resident_and_resets_what_was_moving(tiny_llama, llama_saes, tiny_assets, settings):
    from registry import services

    settings.EMBEDDED = True
    sae = llama_saes["tiny-llama-L1-relu"]
    _recorded(tiny_llama, sae)
    moving = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="was-unloading")
    Model.objects.filter(pk=moving.pk).update(status="unloading")
    job = Job.objects.create(kind="model_unload", target=moving.name, model=moving, status="running")
    summary = startup_reconcile()
    assert summary == {"jobs_interrupted": 1, "downloads_interrupted": 0, "models_reset": 1}
    row = Model.objects.get(pk=tiny_llama.pk)
    assert (row.status, row.locked) == ("loaded", True)
    assert list(Attachment.objects.values_list("sae_id", "layer")) == [(sae.id, 1)]
    assert SAE.objects.get(pk=sae.pk).status == "attached"
    assert Model.objects.get(pk=moving.pk).status == "ready"
    job.refresh_from_db()
    assert (job.status, job.error) == ("failed", "Interrupted by a server restart")


def test_restore_puts_the_recorded_model_and_saes_back(engine_client, tiny_llama, llama_saes):
    sae = llama_saes["tiny-llama-L1-relu"]
    _recorded(tiny_llama, sae)
    assert engine_client.status().state == "empty"
    attempts = Attempts()
    restore_recorded_state(engine=engine_client, begin_restore=attempts.begin, end_restore=attempts.end)
    status = engine_client.status()
    assert (status.state, status.model_id) == ("ready", "tiny-llama")
    assert [(a.sae_id, a.layer, a.layer_module_path) for a in status.attachments] == [(sae.id, 1, "model.layers.1")]
    assert attempts.count == 1 and attempts.ended
    row = Model.objects.get(pk=tiny_llama.pk)
    assert (row.status, row.locked) == ("loaded", True)


def test_a_restore_that_fails_says_so_on_the_rows(engine_client, tiny_llama, llama_saes, tmp_path):
    sae = llama_saes["tiny-llama-L1-relu"]
    _recorded(tiny_llama, sae)
    Model.objects.filter(pk=tiny_llama.pk).update(local_path=str(tmp_path / "gone"))
    restore_recorded_state(engine=engine_client, begin_restore=Attempts().begin, end_restore=lambda: None)
    assert engine_client.status().state == "empty"
    row = Model.objects.get(pk=tiny_llama.pk)
    assert row.status == "error" and "not restored" in row.error_message
    assert not row.locked and not Attachment.objects.exists()
    assert SAE.objects.get(pk=sae.pk).status == "ready"


def test_a_restore_that_keeps_killing_the_process_is_given_up(engine_client, tiny_llama, llama_saes, settings):
    settings.ENGINE_MAX_DELIVERIES = 3
    _recorded(tiny_llama, llama_saes["tiny-llama-L1-relu"])
    attempts = Attempts(count=3)  # three starts died while restoring
    restore_recorded_state(engine=engine_client, begin_restore=attempts.begin, end_restore=attempts.end)
    assert engine_client.status().state == "empty" and attempts.ended
    row = Model.objects.get(pk=tiny_llama.pk)
    assert row.status == "error" and "stopped 3 times" in row.error_message
    assert not Attachment.objects.exists()


def test_auto_load_leaves_a_restored_model_resident(engine_client, tiny_llama, llama_saes, tiny_assets, settings):
    """AUTO_LOAD_MODEL names another model than the one a restart restored (locked, with an
    SAE attached): the recorded state wins, nothing is queued, nothing is refused."""
    from orchestration.startup import auto_load
    from registry import services

    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    sae = llama_saes["tiny-llama-L1-relu"]
    _recorded(tiny_llama, sae)
    restore_recorded_state(engine=engine_client, begin_restore=Attempts().begin, end_restore=Attempts().end)
    settings.AUTO_LOAD_MODEL = "tiny-gpt2"
    settings.AUTO_ATTACH_SAES = []
    assert auto_load() is None
    assert not Job.objects.filter(kind="model_load").exists()
    assert engine_client.status().model_id == "tiny-llama"
    assert Model.objects.get(pk=tiny_llama.pk).status == "loaded"
    assert Model.objects.get(pk=gpt2.pk).status == "ready"
    # with nothing resident, the setting applies
    Attachment.objects.all().delete()
    Model.objects.filter(pk=tiny_llama.pk).update(status="ready", locked=False)
    job = auto_load()
    assert job is not None and job.model_id == gpt2.pk
