"""SAE layouts, metadata, compatibility, model inspection and block resolution (no engine)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from gpu_engine.api.errors import SAEFormatError, UnsupportedArchitecture
from gpu_engine.api.model_dir import inspect_model_dir
from gpu_engine.sae import (
    SAELayout,
    check_compatibility,
    load_sae,
    read_sae_metadata,
    register_layout,
)


def test_metadata_of_every_tiny_sae(tiny_assets):
    for asset in tiny_assets.saes.values():
        cfg = read_sae_metadata(asset.path)
        assert (cfg.d_in, cfg.d_sae, cfg.activation, cfg.layout) == (
            asset.d_in,
            asset.d_sae,
            asset.activation,
            asset.layout,
        )
        assert cfg.k == asset.k
        if asset.layout == "saelens":
            assert (cfg.model_name, cfg.layer, cfg.hook_name) == (asset.model_name, asset.layer, asset.hook_name)


def test_metadata_reads_no_weights_and_imports_no_torch(tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    model = tiny_assets.models["tiny-llama"]
    code = (
        "import sys; from gpu_engine.sae import read_sae_metadata; "
        "from gpu_engine.api.model_dir import inspect_model_dir; "
        f"read_sae_metadata({str(asset.path)!r}); inspect_model_dir({str(model.path)!r}); "
        "import gpu_engine.api.protocol, gpu_engine.api.errors; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules and 'django' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))


def test_loaded_weights_are_the_files_weights_in_canonical_orientation(tiny_assets):
    for asset in tiny_assets.saes.values():
        sae = load_sae(asset.path)
        if asset.layout == "saelens":
            raw = load_file(str(asset.path / "sae_weights.safetensors"))
        else:
            with np.load(asset.path / "params.npz") as z:
                raw = {k: z[k] for k in z.files}
        assert tuple(sae.W_dec.shape) == (asset.d_sae, asset.d_in)
        np.testing.assert_array_equal(sae.W_dec.numpy(), raw["W_dec"])
        np.testing.assert_array_equal(sae.W_enc.numpy(), raw["W_enc"])


def test_saelens_aliases_and_transposed_linear_weights(tiny_assets, tmp_path):
    """dictionary_learning-style names: d_model/dict_size, encoder.weight (d_sae, d_in), decoder.weight (d_in, d_sae)."""
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    raw = load_file(str(asset.path / "sae_weights.safetensors"))
    out = tmp_path / "alias"
    out.mkdir()
    save_file(
        {
            "encoder.weight": np.ascontiguousarray(raw["W_enc"].T),
            "encoder.bias": raw["b_enc"],
            "decoder.weight": np.ascontiguousarray(raw["W_dec"].T),
            "b_dec": raw["b_dec"],
        },
        str(out / "sae_weights.safetensors"),
    )
    (out / "sae_cfg.json").write_text(
        json.dumps(
            {
                "activation_dim": 64,
                "dict_size": 256,
                "layer": 1,
                "model_name": "tiny-llama",
                "apply_b_dec_to_input": True,
            }
        )
    )
    cfg = read_sae_metadata(out)
    assert (cfg.d_in, cfg.d_sae, cfg.layer, cfg.activation, cfg.config_file.endswith("sae_cfg.json")) == (
        64,
        256,
        1,
        "relu",
        True,
    )
    a, b = load_sae(out), load_sae(asset.path)
    assert torch.equal(a.W_dec, b.W_dec) and torch.equal(a.W_enc, b.W_enc)
    x = torch.randn(3, 64)
    assert torch.equal(a.encode(x), b.encode(x))


@pytest.mark.parametrize("alias_in, alias_sae", [("d_model", "d_hidden"), ("input_dim", "num_features")])
def test_config_name_aliases(tiny_assets, tmp_path, alias_in, alias_sae):
    asset = tiny_assets.saes["tiny-llama-L2-topk"]
    out = tmp_path / "a"
    shutil.copytree(asset.path, out)
    cfg = json.loads((out / "cfg.json").read_text())
    for key in ("d_in", "d_sae"):
        cfg.pop(key)
    cfg.update({alias_in: 64, alias_sae: 256})
    (out / "cfg.json").unlink()
    (out / "config.json").write_text(json.dumps(cfg))
    meta = read_sae_metadata(out)
    assert (meta.d_in, meta.d_sae, meta.activation, meta.k) == (64, 256, "topk", asset.k)


def test_broken_files_give_format_errors(tiny_assets, tmp_path):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    missing = tmp_path / "missing"
    shutil.copytree(asset.path, missing)
    raw = load_file(str(missing / "sae_weights.safetensors"))
    raw.pop("W_dec")
    save_file(raw, str(missing / "sae_weights.safetensors"))
    with pytest.raises(SAEFormatError, match="lack W_dec"):
        read_sae_metadata(missing)
    wrong = tmp_path / "wrong"
    shutil.copytree(asset.path, wrong)
    cfg = json.loads((wrong / "cfg.json").read_text())
    cfg["d_sae"] = 300
    (wrong / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFormatError, match="expected 64x300"):
        read_sae_metadata(wrong)
    with pytest.raises(SAEFormatError, match="does not exist"):
        read_sae_metadata(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SAEFormatError, match="No known SAE layout"):
        read_sae_metadata(tmp_path / "empty")


def test_layout_registry_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_layout(SAELayout("saelens", lambda p: None, lambda p: None, lambda c: {}))


def test_compatibility_errors_and_warnings(tiny_assets):
    cfg = read_sae_metadata(tiny_assets.saes["tiny-llama-L1-relu"].path)
    ok = check_compatibility(cfg, hidden_size=64, num_layers=4, layer=1, model_name="tiny-llama")
    assert ok.compatible and ok.errors == [] and ok.warnings == []
    moved = check_compatibility(cfg, hidden_size=64, num_layers=4, layer=2, model_name="org/tiny-gpt2")
    assert moved.compatible and len(moved.warnings) == 2
    bad = check_compatibility(cfg, hidden_size=32, num_layers=2, layer=2)
    assert not bad.compatible and len(bad.errors) == 2


def test_inspect_model_dir_counts_without_loading(tiny_assets):
    from transformers import AutoModelForCausalLM

    for asset in tiny_assets.models.values():
        info = inspect_model_dir(asset.path)
        model = AutoModelForCausalLM.from_pretrained(str(asset.path), local_files_only=True)
        # tied embeddings are stored once, and so are counted once
        n_params = sum(p.numel() for p in model.parameters())
        assert info.param_count == n_params
        assert (info.architecture_class, info.num_layers, info.hidden_size) == (
            asset.architecture_class,
            asset.num_layers,
            asset.hidden_size,
        )
        assert info.vocab_size == model.config.vocab_size
        assert info.context_length > 0 and info.supported and info.has_chat_template
        assert info.disk_size_bytes == sum(f.stat().st_size for f in asset.path.glob("*.safetensors"))
        half = inspect_model_dir(asset.path, "bfloat16")
        assert half.weights_bytes * 2 == info.weights_bytes == 4 * n_params
        assert (
            info.estimated_memory_bytes
            == info.weights_bytes + info.kv_cache_bytes_per_token * info.estimate_context_tokens
        )


TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.mark.parametrize(
    "config_cls, model_cls, path",
    [
        ("MistralConfig", "MistralForCausalLM", "model.layers.1"),
        ("Qwen2Config", "Qwen2ForCausalLM", "model.layers.1"),
        ("Qwen3Config", "Qwen3ForCausalLM", "model.layers.1"),
        ("GemmaConfig", "GemmaForCausalLM", "model.layers.1"),
        ("Gemma3TextConfig", "Gemma3ForCausalLM", "model.layers.1"),
        ("PhiConfig", "PhiForCausalLM", "model.layers.1"),
        ("Phi3Config", "Phi3ForCausalLM", "model.layers.1"),
        ("GPTNeoXConfig", "GPTNeoXForCausalLM", "gpt_neox.layers.1"),
    ],
)
def test_block_resolver_per_architecture(config_cls, model_cls, path):
    import transformers

    from gpu_engine.backends.transformers.blocks import resolve_block

    extra = {"head_dim": 16} if "Gemma" in config_cls or "Qwen3" in config_cls else {}
    if config_cls == "GPTNeoXConfig":
        extra = {"rotary_pct": 1.0}
    cfg = getattr(transformers, config_cls)(**TINY, **extra)
    model = getattr(transformers, model_cls)(cfg)
    module, got = resolve_block(model, 1)
    assert got == path and module is model.get_submodule(path)
    # the engine's hook handles whatever this block returns (tensor or tuple)
    from gpu_engine.interp.hooks import (
        AttachmentPlan,
        AttachmentStats,
        BatchContext,
        HookManager,
        RequestHooks,
        Segment,
    )

    manager, stats = HookManager(), AttachmentStats()
    manager.install(("s", 1), module, stats)
    delta = torch.linspace(-1, 1, 32)
    request = RequestHooks("r", {("s", 1): AttachmentPlan(("s", 1), delta=delta)})
    seen = {}
    pre = module.register_forward_hook(
        lambda m, a, o: seen.__setitem__("raw", (o[0] if isinstance(o, tuple) else o).clone()), prepend=True
    )
    post = module.register_forward_hook(lambda m, a, o: seen.__setitem__("post", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad(), manager.active(BatchContext([Segment(request, 0, 5, 0)])):
            model(torch.arange(3, 8).unsqueeze(0))
    finally:
        pre.remove(), post.remove(), manager.remove_all()
    torch.testing.assert_close(seen["post"], seen["raw"] + delta)
    assert stats.steering_apply_count == 1 and request.plans[("s", 1)].count == 1


def test_unknown_architecture_names_its_class():
    from gpu_engine.backends.transformers.blocks import resolve_block

    class MysteryForCausalLM(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedArchitecture, match="MysteryForCausalLM"):
        resolve_block(MysteryForCausalLM(), 0)


def test_gemma_scope_metadata_from_its_path(tiny_assets, tmp_path):
    asset = tiny_assets.saes["tiny-llama-L2-jumprelu"]
    deep = tmp_path / "gemma-scope-2b-pt-res" / "layer_12" / "width_16k" / "average_l0_71"
    deep.mkdir(parents=True)
    shutil.copy(asset.path / "params.npz", deep / "params.npz")
    cfg = read_sae_metadata(deep / "params.npz")
    assert (cfg.layout, cfg.activation, cfg.layer, cfg.model_name, cfg.hook_name) == (
        "gemmascope",
        "jumprelu",
        12,
        "gemma-2-2b",
        "blocks.12.hook_resid_post",
    )
    assert not cfg.apply_b_dec_to_input and math.isclose(cfg.d_in, 64)
