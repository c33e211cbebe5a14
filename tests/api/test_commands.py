"""Maintenance commands call the same services as the API."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from registry import transfer
from registry.models import SAE, Job, Model
from tests.api.conftest import MODEL_REPO, NPZ_PATH, SAE_REPO
from tests.api.standin_hub import VALID_TOKEN

pytestmark = pytest.mark.django_db


def _run(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command(*args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_download_model_with_a_progress_bar(hub):
    out, err = _run("download_model", MODEL_REPO, "--quantization", "FP32", "--name", "cli")
    row = Model.objects.get(name="cli")
    assert row.status == "ready" and Path(row.local_path, "model.safetensors").is_file()
    assert "Downloaded millm-test/tiny-llama@main as cli" in out
    assert "100%" in err  # the tqdm bar
    job = Job.objects.get(model=row)
    assert job.status == "succeeded" and job.bytes_done == job.bytes_total
    with pytest.raises(CommandError, match="MODEL_ALREADY_EXISTS"):
        _run("download_model", MODEL_REPO, "--quantization", "FP32", "--name", "cli")


def test_download_model_gated_token_from_the_environment(hub, monkeypatch):
    with pytest.raises(CommandError, match="GATED_MODEL_NO_TOKEN"):
        _run("download_model", "millm-test/gated-llama", "--quantization", "FP32")
    monkeypatch.setenv("MY_HF", VALID_TOKEN)
    out, _ = _run("download_model", "millm-test/gated-llama", "--quantization", "FP32", "--hf-token-env", "MY_HF")
    assert Model.objects.get(repo_id="millm-test/gated-llama").status == "ready"
    assert VALID_TOKEN not in out


def test_download_model_local(tiny_assets):
    out, _ = _run("download_model", "--local", str(tiny_assets.models["tiny-gpt2"].path), "--quantization", "FP32")
    assert Model.objects.get(name="tiny-gpt2").source == "local" and "Registered" in out
    with pytest.raises(CommandError, match="INVALID_LOCAL_PATH"):
        _run("download_model", "--local", "/etc")
    with pytest.raises(CommandError, match="one of them"):
        _run("download_model")


def test_download_sae(hub):
    out, _ = _run("download_sae", SAE_REPO, NPZ_PATH)
    sae = SAE.objects.get()
    assert sae.status == "ready" and sae.format == "gemmascope" and sae.id in out
    again, _ = _run("download_sae", SAE_REPO, NPZ_PATH)
    assert again.strip() == f"{sae.id}: cached"


def test_engine_commands_point_at_the_api_in_embedded_mode(tiny_llama):
    for args in (
        ("load_model", "tiny-llama"),
        ("unload_model", "tiny-llama"),
        ("attach_sae", "sae_x", "1"),
        ("detach_sae", "sae_x"),
    ):
        with pytest.raises(CommandError, match="Embedded mode"):
            _run(*args)
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"


def test_engine_commands_call_the_services_where_the_engine_is_reachable(
    settings, engine_client, tiny_llama, llama_saes, tiny_assets, tmp_path
):
    settings.EMBEDDED = False  # as in distributed mode, where run_engine is reachable
    out, _ = _run("load_model", "tiny-llama")
    assert "Loaded tiny-llama on cpu" in out
    sae = llama_saes["tiny-llama-L1-relu"]
    out, _ = _run("attach_sae", sae.id, "1")
    assert "model.layers.1" in out
    with pytest.raises(CommandError, match="MODEL_LOCKED"):
        _run("unload_model", "tiny-llama")
    _run("detach_sae", sae.id)
    # capture works on what the engine holds: another model's name is refused, not
    # answered with this model's activations under that name
    from registry import services as registry_services

    registry_services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    prompts = tmp_path / "capture-prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(CommandError, match="the engine holds tiny-llama, not tiny-gpt2"):
        _run("capture", "tiny-gpt2", "--input", str(prompts), "--out", str(tmp_path / "caps"), "--layers", "0")
    _run("unload_model", str(tiny_llama.id))
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    with pytest.raises(CommandError, match="MODEL_NOT_FOUND"):
        _run("load_model", "nope")


def test_prune_cache(hub, settings):
    _run("download_model", MODEL_REPO, "--quantization", "FP32")
    _run("download_sae", SAE_REPO, NPZ_PATH)
    model = Model.objects.get()
    sae = SAE.objects.get()
    models_root = Path(settings.MODEL_CACHE_DIR)
    orphan_model = models_root / "someone--old--m99"
    orphan_model.mkdir()
    (orphan_model / "model.safetensors").write_bytes(b"x" * 1000)
    stray_file = models_root / "stray.bin"
    stray_file.write_bytes(b"y" * 10)
    repo_dir = transfer.sae_target_dir(sae).parent
    orphan_sae = repo_dir / "sae_deadbeef"
    orphan_sae.mkdir()
    (orphan_sae / "params.npz").write_bytes(b"z" * 100)

    out, _ = _run("prune_cache", "--dry-run")
    assert "Dry run: 3 unreferenced item(s)" in out
    assert orphan_model.exists() and stray_file.exists() and orphan_sae.exists()
    for path in (orphan_model, stray_file, orphan_sae):
        assert f"would remove {path}" in out

    out, _ = _run("prune_cache")
    assert "Pruned 3 unreferenced item(s)" in out
    assert not orphan_model.exists() and not stray_file.exists() and not orphan_sae.exists()
    # what the registry references is untouched
    assert Path(model.local_path, "model.safetensors").is_file()
    assert Path(sae.local_path, "params.npz").is_file()


def test_check_config_lists_the_new_variables(run_manage, tmp_path):
    result = run_manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    for name in ("MILLM_API_KEYS=", "HF_CIRCUIT_FAIL_MAX=5", "HF_CIRCUIT_RESET_TIMEOUT_S=60"):
        assert name in result.stdout


def test_capture_command_writes_one_artifact_per_prompt_offline(tiny_llama, tiny_assets, tmp_path, settings):
    """manage.py capture (embedded: its own engine in this process) writes each prompt's
    capture; the rows equal a float32 forward of the same weights made here."""
    import json

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_engine.api.artifacts import load_capture

    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "cpu", "float32"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "prompt": "the sea and the sky"}\n\n{"prompt": "a quick brown fox", "max_tokens": 3}\n'
    )
    out_dir = tmp_path / "caps"
    out, _ = _run(
        "capture",
        "tiny-llama",
        "--input",
        str(prompts),
        "--out",
        str(out_dir),
        "--layers",
        "0,2",
        "--positions",
        "prompt",
        "--max-tokens",
        "4",
    )
    assert "2 capture(s) written" in out
    index = [json.loads(line) for line in (out_dir / "index.jsonl").read_text().splitlines()]
    assert [(r["line"], r["id"]) for r in index] == [(1, "a"), (3, None)]
    assert [r["usage"]["completion_tokens"] for r in index] == [4, 3]
    path = tiny_assets.models["tiny-llama"].path
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    for row, text in zip(index, ("the sea and the sky", "a quick brown fox")):
        cap = load_capture(out_dir / row["file"])
        assert json.loads((out_dir / f"{row['capture_id']}.json").read_text())["layers"] == [0, 2]
        ids = tok(text)["input_ids"]
        assert cap.token_ids.tolist() == ids
        with torch.inference_mode():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (0, 2):
            np.testing.assert_allclose(cap.hidden[layer], hidden[layer + 1][0].numpy(), atol=1e-4)
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"  # the registry is untouched
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"nope": 1}\n')
    with pytest.raises(CommandError, match="line 2: give exactly one of prompt, messages"):
        _run("capture", "tiny-llama", "--input", str(bad), "--out", str(out_dir), "--layers", "0")
    with pytest.raises(CommandError, match="invalid_parameter"):
        _run(
            "capture",
            "tiny-llama",
            "--input",
            str(prompts),
            "--out",
            str(out_dir),
            "--layers",
            "0",
            "--positions",
            "middle",
        )
    # refused before anything runs: no folder made, no weights loaded, one line each
    fresh = tmp_path / "never-made"
    num_layers = Model.objects.get(pk=tiny_llama.id).num_layers
    with pytest.raises(CommandError, match=f"--layers: tiny-llama has layers 0-{num_layers - 1}, not {num_layers}"):
        _run("capture", "tiny-llama", "--input", str(prompts), "--out", str(fresh), "--layers", f"0,{num_layers}")
    with pytest.raises(CommandError, match="--attention-layers"):
        _run("capture", "tiny-llama", "--input", str(prompts), "--out", str(fresh), "--attention-layers", "99")
    with pytest.raises(CommandError, match="invalid_parameter"):
        _run("capture", "tiny-llama", "--input", str(prompts), "--out", str(fresh), "--positions", "middle")
    assert not fresh.exists()
    with pytest.raises(CommandError, match="cannot create it"):
        _run("capture", "tiny-llama", "--input", str(prompts), "--out", "/proc/no/such", "--layers", "0")
