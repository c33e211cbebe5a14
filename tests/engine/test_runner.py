"""Loading: dtypes, devices, context window, refusals at load time."""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_engine.engine import Engine
from gpu_engine.errors import ModelLoadFailed, ModelNotLoaded, UnsupportedArchitecture
from gpu_engine.protocol import GenerationJob, LoadModelJob, SamplingParams


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_load_and_generate(tiny_assets, dtype, torch_dtype):
    asset = tiny_assets.models["tiny-llama"]
    with Engine() as eng:
        status = eng.load_model(LoadModelJob("m", str(asset.path), dtype=dtype, device="auto"))
        assert (status.dtype, status.device) == (dtype, "cuda" if torch.cuda.is_available() else "cpu")
        assert next(eng.backend.model.parameters()).dtype == torch_dtype
        out = eng.generate_sync(GenerationJob("g", prompt="hello", sampling=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
        assert len(out.token_ids) == 3


def test_context_length_comes_from_the_config_and_can_be_capped(tiny_assets):
    asset = tiny_assets.models["tiny-gpt2"]
    with Engine() as eng:
        eng.load_model(LoadModelJob("m", str(asset.path), device="cpu"))
        assert eng.status().context_length == eng.backend.model.config.n_positions
        eng.load_model(LoadModelJob("m", str(asset.path), device="cpu", max_context_length=32))
        assert eng.status().context_length == 32


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with Engine() as eng, pytest.raises(UnsupportedArchitecture, match="BloomForCausalLM"):
        eng.load_model(LoadModelJob("bloom", str(tmp_path), device="cpu"))


def test_requests_without_a_model_and_bad_directories(tmp_path, tiny_assets):
    with Engine() as eng:
        with pytest.raises(ModelNotLoaded):
            eng.generate_sync(GenerationJob("g", prompt="x"))
        with pytest.raises(ModelLoadFailed):
            eng.load_model(LoadModelJob("none", str(tmp_path), device="cpu"))
        # a failed load leaves the engine empty but usable
        assert eng.status().state == "empty"
        src = tiny_assets.models["tiny-llama"].path
        shutil.copytree(src, tmp_path / "m")
        eng.load_model(LoadModelJob("m", str(tmp_path / "m"), device="cpu"))
        assert eng.status().state == "ready"
        eng.unload_model()
        assert eng.status().state == "empty"
