"""Q8/Q4 rows load through the API and the management command, and what was loaded shows
on /api/health/inference (the weights' quantization and bytes per dtype, checked against
the checkpoint's own header); Q2 and pre-quantized checkpoints this host cannot load are
a 400 UNSUPPORTED_QUANTIZATION before any job is queued (the engine's check_load)."""

from __future__ import annotations

import json
import shutil

import pytest
from django.core.management import call_command
from safetensors import safe_open

from orchestration import tasks
from registry import services
from registry.models import Job, Model
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db

BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _block_weights(path) -> tuple[int, int]:
    """(elements, output rows) of tiny-llama's decoder-block linear weights, from its header."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(n).get_shape() for n in f.keys() if ".layers." in n and n.split(".")[-2] in BLOCK_LINEARS]
    return sum(o * i for o, i in shapes), sum(o for o, _ in shapes)


@pytest.mark.parametrize("quantization, weight_dtype, per_weight", [("Q8", "int8", 1.0), ("Q4", "uint8", 0.5)])
def test_a_quantized_row_loads_through_the_api(api, engine_client, tiny_assets, quantization, weight_dtype, per_weight):
    asset = tiny_assets.models["tiny-llama"]
    row = services.model_register_local(
        local_path=str(asset.path), name=f"llama-{quantization}", quantization=quantization
    )
    job = ok(api.post(f"/api/models/{row.id}/load"), 202)["job"]
    assert run_job(tasks.model_load_task, job["id"]) == "succeeded"
    assert Model.objects.get(pk=row.id).status == "loaded"
    health = ok(api.get("/api/health/inference"))
    n_weights, _ = _block_weights(asset.path)
    weights = health["weights"]
    assert weights["quantization"] == quantization
    assert weights["bytes_by_dtype"][weight_dtype] == int(n_weights * per_weight)
    # the float32 head packed where MILLM_ENGINE_PACK_WEIGHTS=auto's one-row probe says so
    probe = health["capabilities"]["kernel_probe"]
    head = "onednn_packed" if probe["packed_ms"] <= probe["default_ms"] else "default"
    assert health["kernels"] == f"{quantization.lower()}_weight_only+{head}"
    # each backend says which quantizations a load there can apply
    listed = {b["name"]: b for b in health["backends"]}
    assert listed["transformers"]["quantizations"]["Q8"]["available"] is True
    assert listed["transformers"]["quantizations"]["Q2"]["available"] is False


def test_load_model_command_loads_a_q8_row(engine_client, tiny_assets, settings):
    settings.EMBEDDED = False  # as in distributed mode, where run_engine is reachable
    services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="llama-q8", quantization="Q8"
    )
    call_command("load_model", "llama-q8")
    assert engine_client.status().weights["quantization"] == "Q8"
    assert Model.objects.get(name="llama-q8").status == "loaded"


def test_q2_is_refused_with_the_reason_and_no_job(api, engine_client, tiny_assets, tiny_llama):
    q2 = services.model_register_local(
        local_path=str(tiny_assets.models["tiny-gpt2"].path), name="gpt2-q2", quantization="Q2"
    )
    error = refused(api.post(f"/api/models/{q2.id}/load"), 400, "UNSUPPORTED_QUANTIZATION")
    assert error["details"] == {
        "model_id": q2.id,
        "quantization": "Q2",
        "backend": "transformers",
        "supported": ["FP32", "FP16", "Q4", "Q8"],
    }
    assert "2-bit" in error["message"]
    assert not Job.objects.filter(kind="model_load").exists()
    assert Model.objects.get(pk=q2.id).status == "ready"


def test_a_quantized_row_on_a_backend_without_quantization_is_refused(api, engine_client, tiny_assets):
    row = services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="llama-q8-vllm", quantization="Q8"
    )
    Model.objects.filter(pk=row.id).update(backend="vllm")
    error = refused(api.post(f"/api/models/{row.id}/load"), 400, "UNSUPPORTED_QUANTIZATION")
    assert "vllm backend loads transformers checkpoints at FP32/FP16 only" in error["message"]


def test_a_prequantized_checkpoint_this_host_cannot_load_is_a_400(api, engine_client, tiny_assets, tmp_path):
    target = tmp_path / "bnb"
    shutil.copytree(tiny_assets.models["tiny-llama"].path, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (target / "config.json").write_text(json.dumps(config))
    # registered FP32: the checkpoint's own method decides, not the row's choice
    row = services.model_register_local(local_path=str(target), name="llama-bnb")
    error = refused(api.post(f"/api/models/{row.id}/load"), 400, "UNSUPPORTED_QUANTIZATION")
    assert error["details"]["checkpoint_quantization"] == "bitsandbytes_4bit"
    assert "bitsandbytes" in error["message"]
    assert not Job.objects.filter(kind="model_load").exists()
    assert Model.objects.get(pk=row.id).status == "ready"
    assert engine_client.status().state == "empty"
