"""The SmolLM2-135M demo: a float32 checkpoint and an SAE whose labelled features steer.

Each steering check has its own positive control: the unsteered greedy text is
generated in the same test, and a steer must both change it and (for the ocean
feature) bring in the concept's words.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from offline_assets import DEMO_MODEL_NAME, DEMO_SAE_NAME, AssetManifest

pytestmark = pytest.mark.demo_model

PROMPT = "Tell me about your weekend."
OCEAN_WORDS = ("sea", "ocean", "deep", "wave", "tide", "shore")


@pytest.fixture(scope="module")
def demo(demo_assets: AssetManifest):
    model_asset = demo_assets.models[DEMO_MODEL_NAME]
    sae = demo_assets.saes[DEMO_SAE_NAME]
    model = AutoModelForCausalLM.from_pretrained(model_asset.path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_asset.path, local_files_only=True)
    weights = load_file(str(sae.path / "sae_weights.safetensors"))
    return model_asset, sae, model, tokenizer, weights


@torch.no_grad()
def _greedy(model, tokenizer, layer_path: str, delta: np.ndarray | None, max_new_tokens: int = 24) -> str:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt"
    )
    handle = None
    if delta is not None:
        vector = torch.from_numpy(delta)

        def add(_module, _inputs, output):
            if isinstance(output, tuple):
                return (output[0] + vector, *output[1:])
            return output + vector

        handle = model.get_submodule(layer_path).register_forward_hook(add)
    try:
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        if handle is not None:
            handle.remove()
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_demo_checkpoint_is_plain_float32(demo) -> None:
    model_asset, _sae, model, tokenizer, _weights = demo
    config = json.loads((model_asset.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert model.dtype == torch.float32
    assert model_asset.num_layers == config["num_hidden_layers"] == 30
    assert model_asset.hidden_size == 576
    assert tokenizer.chat_template
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def test_demo_sae_labels_match_manifest(demo) -> None:
    _model_asset, sae, _model, _tokenizer, weights = demo
    labels = json.loads((sae.path / "feature_labels.json").read_text())
    assert {int(i): label for i, label in labels.items()} == sae.feature_labels
    assert len(sae.feature_labels) >= 3
    assert sae.steering_strength is not None and 5 <= sae.steering_strength <= 20
    assert weights["W_dec"].shape == (sae.d_sae, sae.d_in)
    cfg = json.loads((sae.path / "cfg.json").read_text())
    assert cfg["hook_name"] == f"blocks.{sae.layer}.hook_resid_post"
    assert cfg["architecture"] == "standard"


def test_labelled_features_visibly_steer_greedy_text(demo) -> None:
    model_asset, sae, model, tokenizer, weights = demo
    layer_path = model_asset.layer_module_path(sae.layer)
    baseline = _greedy(model, tokenizer, layer_path, None)
    for index, label in sae.feature_labels.items():
        steered = _greedy(model, tokenizer, layer_path, sae.steering_strength * weights["W_dec"][index])
        assert steered != baseline, f"feature {index} ({label}) did not change the text"
        if label.startswith("ocean"):
            assert any(word in steered.lower() for word in OCEAN_WORDS), steered
            assert not any(word in baseline.lower() for word in OCEAN_WORDS), baseline


@torch.no_grad()
def test_ocean_feature_fires_on_ocean_text(demo) -> None:
    model_asset, sae, model, tokenizer, weights = demo
    ocean = next(i for i, label in sae.feature_labels.items() if label.startswith("ocean"))
    captured: list[torch.Tensor] = []
    handle = model.get_submodule(model_asset.layer_module_path(sae.layer)).register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        for text in (
            "Dolphins leapt over the waves of the open sea.",
            "The invoice lists three items and a total.",
        ):
            model(**tokenizer(text, return_tensors="pt"))
    finally:
        handle.remove()
    acts = []
    for residual in captured:
        x = residual[0, 1:].double().numpy() - weights["b_dec"]
        acts.append(np.maximum(x @ weights["W_enc"][:, ocean] + weights["b_enc"][ocean], 0).mean())
    assert acts[0] > 0.5 and acts[0] > 3 * acts[1], acts
