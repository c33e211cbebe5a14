"""Memory fit, decided before anything moves (TRANSFORMERS_MIN_CONTEXT on the CPU): a
transformers load needs its weights plus the KV cache of the minimum context, an SAE
attach must leave that KV room free, and what does not fit is a 507 INSUFFICIENT_MEMORY
with per-card details; the registry and the engine are left as they were.

The figures are computed here from the checkpoint (its safetensors tensors and config) and
from the machine's /proc/meminfo, not from the code under test."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from orchestration import tasks
from registry.models import SAE, Attachment, Job, Model
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db

MB = 2**20


@pytest.fixture
def long_window_llama(tiny_assets, tmp_path):
    """tiny-llama's weights with a window of a billion tokens: the minimum context alone
    decides how much KV room a load needs."""
    from registry import services

    folder = tmp_path / "long-llama"
    shutil.copytree(tiny_assets.models["tiny-llama"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 10**9
    (folder / "config.json").write_text(json.dumps(config))
    return services.model_register_local(local_path=str(folder), name="long-llama")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def checkpoint(model: Model) -> tuple[int, int]:
    """(float32 weight bytes, float32 KV bytes a token) of the model's checkpoint."""
    from pathlib import Path

    folder = Path(model.local_path)
    weights = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            for name in f.keys():
                weights += _numel(f.get_slice(name).get_shape()) * 4
    config = json.loads((folder / "config.json").read_text())
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    return weights, kv


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def test_a_load_that_does_not_fit_the_hosts_memory_is_refused_before_anything_moves(
    api, engine_client, long_window_llama, settings
):
    weights, kv = checkpoint(long_window_llama)
    # twice what the host has free, in KV cache alone
    settings.TRANSFORMERS_MIN_CONTEXT = 2 * mem_available() // kv
    error = refused(api.post(f"/api/models/{long_window_llama.id}/load"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    expected = weights + kv * settings.TRANSFORMERS_MIN_CONTEXT
    assert d["needed_mb"] == round(expected / MB)
    assert d["kv_cache_mb"] == round(kv * settings.TRANSFORMERS_MIN_CONTEXT / MB)
    assert d["min_context_tokens"] == settings.TRANSFORMERS_MIN_CONTEXT
    (card,) = d["cards"]
    assert card["device"] == "cpu" and card["context_reserve_mb"] == 0
    assert abs(card["free_mb"] - mem_available() / MB) < 0.1 * mem_available() / MB
    assert card["needed_mb"] > card["usable_mb"]
    # nothing moved: no job, the row as it was, the engine empty
    assert not Job.objects.filter(kind="model_load").exists()
    assert Model.objects.get(pk=long_window_llama.id).status == "ready"
    assert engine_client.status().state == "empty"

    # the same model with the default minimum context fits, and loads
    settings.TRANSFORMERS_MIN_CONTEXT = 4096
    data = ok(api.post(f"/api/models/{long_window_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    assert engine_client.status().model_id == "long-llama"
    memory = ok(api.get("/api/health/inference"))["memory"]
    assert memory["idle_release_s"] == float(settings.TRANSFORMERS_IDLE_CACHE_RELEASE_S)
    assert memory["idle_releases"] == 0


def test_the_load_job_decides_again_with_what_is_free_when_it_runs(api, engine_client, long_window_llama, settings):
    data = ok(api.post(f"/api/models/{long_window_llama.id}/load"), 202)
    # between the request and the job, the room needed grows past what the host has
    _, kv = checkpoint(long_window_llama)
    settings.TRANSFORMERS_MIN_CONTEXT = 2 * mem_available() // kv
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "failed"
    job = Job.objects.get(pk=data["job"]["id"])
    assert "needs about" in job.error and "cpu" in job.error
    assert Model.objects.get(pk=long_window_llama.id).status == "ready"
    assert engine_client.status().state == "empty"


def test_an_sae_attach_keeps_the_kv_room_free(api, engine_client, long_window_llama, llama_saes, settings, published):
    settings.TRANSFORMERS_MIN_CONTEXT = 4096
    data = ok(api.post(f"/api/models/{long_window_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    sae = next(iter(llama_saes.values()))
    _, kv = checkpoint(long_window_llama)
    # the model is resident; leaving the KV room of this many tokens would take more than
    # the host has free
    settings.TRANSFORMERS_MIN_CONTEXT = 2 * mem_available() // kv
    error = refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert d["sae_ids"] == [sae.id]
    assert d["kv_cache_mb"] == round(kv * settings.TRANSFORMERS_MIN_CONTEXT / MB)
    assert d["cards"][0]["device"] == "cpu"
    assert not Attachment.objects.exists()
    assert SAE.objects.get(pk=sae.id).status == "ready"
    assert engine_client.status().attachments == []
    assert "sae:attached" not in [name for name, _ in published]

    settings.TRANSFORMERS_MIN_CONTEXT = 4096
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    assert [a.sae_id for a in engine_client.status().attachments] == [sae.id]
