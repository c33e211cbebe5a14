"""Loading: dtypes, devices, context window, refusals at load time."""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import ModelLoadFailed, ModelNotLoaded, UnsupportedArchitecture
from gpu_engine.api.protocol import GenerationJob, LoadModelJob, SamplingParams


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_load_and_generate(tiny_assets, dtype, torch_dtype):
    asset = tiny_assets.models["tiny-llama"]
    with Engine() as eng:
        status = eng.load_model(LoadModelJob("m", str(asset.path), dtype=dtype, device="auto"))
        assert (status.dtype, status.device) == (dtype, "cuda" if torch.cuda.is_available() else "cpu")
        assert next(eng.backend.model.parameters()).dtype == torch_dtype
        out = eng.generate_sync(
            GenerationJob("g", prompt="hello", sampling=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        )
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


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma2"])
def test_cpu_float32_weights_are_packed_and_give_the_plain_models_results(tiny_assets, model_name):
    """MILLM_ENGINE_PACK_WEIGHTS' engine side: every nn.Linear becomes a prepacked oneDNN
    linear; its logits equal an independently loaded plain model's within float32
    rounding and greedy decoding picks the same tokens; pack_cpu_weights=False keeps
    PyTorch's own modules."""
    from transformers import AutoModelForCausalLM

    from gpu_engine.backends.transformers.cpu_kernels import PackedGroup, PackedLinear, PackedSlice

    assert torch.backends.mkldnn.is_available()  # the pinned CPU build has oneDNN: no silent skip
    asset = tiny_assets.models[model_name]
    plain = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32).eval()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    ids = torch.tensor([[1, 17, 42, 99, 311, 7, 256, 64]])
    with Engine() as packed, Engine() as unpacked:
        packed.load_model(LoadModelJob("m", str(asset.path), device="cpu", options={"pack_cpu_weights": True}))
        unpacked.load_model(LoadModelJob("m", str(asset.path), device="cpu", options={"pack_cpu_weights": False}))
        assert packed.status().kernels == "onednn_packed" and unpacked.status().kernels == "default"
        model = packed.backend.model
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        # q/k/v and gate/up packed as one weight each (their modules: slices of it), the
        # other linears one by one
        singles = sum(type(m) is PackedLinear for m in model.modules())
        slices = [m for m in model.modules() if type(m) is PackedSlice]
        assert singles + len(slices) == n_linear
        groups = [m for m in model.modules() if type(m) is PackedGroup]
        assert len(groups) == 2 * plain.config.num_hidden_layers and len(slices) == 5 * len(groups) // 2
        assert sum(isinstance(m, torch.nn.Linear) for m in unpacked.backend.model.modules()) == n_linear
        with torch.inference_mode():
            want = plain(ids).logits
            got = model(ids).logits
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        # a group's product, shared by its members within one call, is not held after it
        assert all(g._x is None and g._out is None for g in groups)
        prompt = packed.backend.encode_text("the cat")
        with torch.inference_mode():
            ref = plain.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        job = GenerationJob(
            "g", prompt="the cat", sampling=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        )
        assert packed.generate_sync(job).token_ids == ref
        assert unpacked.generate_sync(job).token_ids == ref
