"""Registry services: what an operator registers is described from its own files, refusals
leave nothing behind, and jobs report progress on the row and over the event bus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from asgiref.sync import async_to_sync
from celery import shared_task
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management import call_command
from safetensors import safe_open

from core import events, jobs
from registry import job_lifecycle, selectors, services
from registry.errors import (
    InvalidLocalPath,
    JobFinished,
    ModelAlreadyExists,
    ModelInvalid,
    ModelLoaded,
    ModelLocked,
    SAEAlreadyAttached,
)
from registry.models import SAE, Job, Model

pytestmark = pytest.mark.django_db


def _param_count(model_dir: Path) -> int:
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, "np") as fh:
            for key in fh.keys():
                total += int(np.prod(fh.get_slice(key).get_shape()))
    return total


def test_register_local_transformers_model_reads_its_files(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    model = services.model_register_local(local_path=str(asset.path), name="llama-local")
    cfg = json.loads((Path(asset.path) / "config.json").read_text())
    row = Model.objects.get(pk=model.pk)
    assert row.source == "local" and row.format == "transformers" and row.status == "ready"
    assert row.architecture == cfg["architectures"][0] == "LlamaForCausalLM"
    assert row.num_layers == cfg["num_hidden_layers"]
    assert row.hidden_size == cfg["hidden_size"]
    assert row.context_length == cfg["max_position_embeddings"]
    assert row.parameter_count == _param_count(Path(asset.path))
    assert row.disk_size_bytes == sum(p.stat().st_size for p in Path(asset.path).glob("*.safetensors"))
    # Estimated memory covers at least the float32 weights.
    assert row.estimated_memory_bytes >= row.parameter_count * 4
    assert selectors.model_get(model_id="llama-local").pk == row.pk
    assert selectors.model_get(model_id=str(row.pk)).pk == row.pk


@pytest.mark.parametrize(
    ("path", "fragment", "roots"),
    [
        ("relative/dir", "absolute", None),
        # outside LOCAL_MODEL_ROOTS: one answer whether it exists or not
        ("/nonexistent/model", "LOCAL_MODEL_ROOTS", None),
        ("/etc", "LOCAL_MODEL_ROOTS", None),
        # an operator whose roots take in the whole disk still cannot register these
        ("/nonexistent/model", "does not exist", ("/",)),
        ("/etc", "system directory", ("/",)),
        ("/usr/lib/python3", "system directory", ("/",)),
        ("/", "system directory", ("/",)),
    ],
)
def test_register_local_refuses_bad_paths(path, fragment, roots, settings):
    if roots is not None:
        settings.LOCAL_MODEL_ROOTS = roots
    with pytest.raises(InvalidLocalPath) as info:
        services.model_register_local(local_path=path)
    assert fragment in info.value.message
    assert info.value.status == 400 and info.value.code == "INVALID_LOCAL_PATH"
    assert Model.objects.count() == 0


def test_register_local_refuses_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelInvalid):
        services.model_register_local(local_path=str(tmp_path))
    assert Model.objects.count() == 0


def test_names_are_unique(tiny_assets):
    path = str(tiny_assets.models["tiny-gpt2"].path)
    services.model_register_local(local_path=path, name="gpt")
    with pytest.raises(ModelAlreadyExists):
        services.model_register_local(local_path=path, name="gpt")
    assert Model.objects.filter(name="gpt").count() == 1


def test_delete_is_refused_while_locked_or_loaded(tiny_assets):
    model = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path))
    services.model_lock(model=model)
    with pytest.raises(ModelLocked):
        services.model_delete(model=model)
    services.model_unlock(model=model)
    services.model_set_status(model=model, status=Model.Status.LOADED)
    with pytest.raises(ModelLoaded):
        services.model_delete(model=model)
    assert Model.objects.filter(pk=model.pk).exists()
    assert Model.objects.get(pk=model.pk).loaded_at is not None


def test_delete_never_removes_a_local_registrations_files(tiny_assets, tmp_path, django_capture_on_commit_callbacks):
    """A row removes only what the registry downloaded for it (docs/security.md): a local
    registration keeps its files, in the model cache (it may be another model's download)
    or anywhere else."""
    cached = Path(settings.MODEL_CACHE_DIR) / "copied-gpt2"
    shutil.copytree(tiny_assets.models["tiny-gpt2"].path, cached)
    own = tmp_path / "own-gpt2"
    shutil.copytree(tiny_assets.models["tiny-gpt2"].path, own)
    in_cache = services.model_register_local(local_path=str(cached), name="cached")
    outside = services.model_register_local(local_path=str(own), name="own")
    with django_capture_on_commit_callbacks(execute=True):
        services.model_delete(model=in_cache)
        services.model_delete(model=outside)
    assert (cached / "config.json").is_file()
    assert (own / "config.json").is_file()
    assert Model.objects.count() == 0


def test_register_saes_in_both_layouts(tiny_assets):
    for asset in tiny_assets.saes.values():
        sae = services.sae_register_local(local_path=str(asset.path), name=asset.name)
        row = SAE.objects.get(pk=sae.pk)
        assert row.id.startswith("sae_")
        assert row.format == asset.layout and row.activation == asset.activation
        path = Path(asset.path)
        if asset.layout == "saelens":
            cfg = json.loads((path / "cfg.json").read_text())
            assert (row.d_in, row.d_sae) == (cfg["d_in"], cfg["d_sae"])
            assert row.hook_name == cfg["hook_name"]
        else:
            npz = path if path.suffix == ".npz" else path / "params.npz"
            w_dec = np.load(npz)["W_dec"]
            assert (row.d_sae, row.d_in) == w_dec.shape
        if asset.layout == "saelens":
            assert row.trained_on_layer == cfg["hook_layer"] == asset.layer
        else:
            # params.npz names no layer; what the operator knows fills the gap.
            assert row.trained_on_layer is None
            services.sae_delete(sae=row)  # the same files are registered once
            hinted = services.sae_register_local(local_path=str(asset.path), trained_on_layer=asset.layer)
            assert SAE.objects.get(pk=hinted.pk).trained_on_layer == asset.layer
        assert row.width == row.d_sae


def test_attached_sae_cannot_be_deleted(tiny_assets):
    asset = next(iter(tiny_assets.saes.values()))
    sae = services.sae_register_local(local_path=str(asset.path))
    SAE.objects.filter(pk=sae.pk).update(status=SAE.Status.ATTACHED)
    with pytest.raises(SAEAlreadyAttached):
        services.sae_delete(sae=sae)
    assert SAE.objects.filter(pk=sae.pk).exists()


def _listen():
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(events.GROUP, channel)
    return layer, channel


def test_job_progress_is_stored_and_published_in_order():
    layer, channel = _listen()
    job = job_lifecycle.job_create(kind=Job.Kind.MODEL_DOWNLOAD, target="org/repo")
    job_lifecycle.job_start(job=job, stage="downloading")
    for done in (25, 50, 75):
        job_lifecycle.job_progress(job=job, progress=done, bytes_done=done * 10, bytes_total=1000)
    job_lifecycle.job_finish(job=job, status=Job.Status.SUCCEEDED)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.progress, row.bytes_done, row.bytes_total) == ("succeeded", 100, 750, 1000)
    assert row.started_at <= row.finished_at
    received = [async_to_sync(layer.receive)(channel) for _ in range(4)]
    assert [m["event"] for m in received] == ["model:download:progress"] * 3 + ["model:download:complete"]
    assert [m["data"]["progress"] for m in received] == [25, 50, 75, 100]
    assert all(m["data"]["job_id"] == job.pk for m in received)


def test_cancel_queued_job_and_refuse_a_finished_one():
    queued = job_lifecycle.job_create(kind=Job.Kind.SAE_DOWNLOAD, target="org/sae")
    job_lifecycle.job_cancel(job=queued)
    assert Job.objects.get(pk=queued.pk).status == "cancelled"
    running = job_lifecycle.job_start(job=job_lifecycle.job_create(kind="sae_download", target="x"))
    job_lifecycle.job_cancel(job=running)
    row = Job.objects.get(pk=running.pk)
    assert row.status == "running" and row.cancel_requested
    with pytest.raises(JobFinished):
        job_lifecycle.job_cancel(job=queued)


@shared_task(name="tests.mark_job")
def mark_job(job_id: int, stage: str) -> str:
    job = Job.objects.get(pk=job_id)
    job_lifecycle.job_start(job=job, stage=stage)
    return stage


@pytest.mark.django_db(transaction=True)
def test_embedded_tasks_run_in_process_after_commit():
    from django.db import transaction

    job = job_lifecycle.job_create(kind=Job.Kind.MAINTENANCE, target="t")
    with transaction.atomic():
        future = jobs.enqueue(mark_job, job.pk, "ran-in-thread")
        # Not dispatched before the transaction commits.
        assert not future.done()
    assert future.result(timeout=30) == "ran-in-thread"
    assert Job.objects.get(pk=job.pk).stage == "ran-in-thread"


def test_demo_assets_are_registered_once(tiny_assets):
    call_command("create_demo_assets", "--tiny-only", "--output", str(tiny_assets.root))
    names = set(Model.objects.values_list("name", flat=True))
    assert {"tiny-llama", "tiny-gemma2", "tiny-gpt2"} <= names
    assert SAE.objects.count() == len(tiny_assets.saes)
    for asset in tiny_assets.saes.values():
        row = SAE.objects.get(name=asset.name)
        assert (row.trained_on_model, row.trained_on_layer) == (asset.model_name, asset.layer)
    call_command("create_demo_assets", "--tiny-only", "--output", str(tiny_assets.root))
    assert Model.objects.count() == len(names)
    assert SAE.objects.count() == len(tiny_assets.saes)
