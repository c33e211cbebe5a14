"""The offline asset builders: loadable, deterministic, cached, and non-trivial SAEs.

Expectations are computed here from the raw files (safetensors/npz/cfg.json) and a
forward hook on the model, independently of the engine's SAE code, so these tests hold
the assets to their documented layouts rather than to whatever the loader accepts.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from offline_assets import (
    TINY_MODELS,
    AssetManifest,
    ModelAsset,
    SAEAsset,
    build_sae,
    build_tiny_model,
    ensure_assets,
)
from offline_assets.build import MANIFEST_NAME

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPECTED_SAES = {
    "tiny-llama-L1-relu": ("tiny-llama", 1, "saelens", "relu"),
    "tiny-llama-L2-jumprelu": ("tiny-llama", 2, "gemmascope", "jumprelu"),
    "tiny-llama-L2-topk": ("tiny-llama", 2, "saelens", "topk"),
    "tiny-llama-L3-relu": ("tiny-llama", 3, "saelens", "relu"),
    "tiny-gemma2-L2-jumprelu": ("tiny-gemma2", 2, "gemmascope", "jumprelu"),
    "tiny-gpt2-L1-relu": ("tiny-gpt2", 1, "saelens", "relu"),
}
# Text the builders never saw, so SAE calibration is checked out of sample.
HELD_OUT_TEXT = (
    "Yesterday the engineers measured the bridge, argued about the numbers, "
    "and finally agreed to paint it green before the festival in October."
)
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".json", ".jinja")


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every asset file under ``root`` (manifest and lock excluded)."""
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.suffix in WEIGHT_SUFFIXES and path.name != MANIFEST_NAME
    }


def _mtimes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _load(model: ModelAsset):
    hf_model = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model.path, local_files_only=True)
    return hf_model, tokenizer


@torch.no_grad()
def _block_output(model: ModelAsset, hf_model, tokenizer, layer: int, text: str) -> np.ndarray:
    """Residual stream after block ``layer`` (all positions but BOS), via a forward hook."""
    captured: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    handle = hf_model.get_submodule(model.layer_module_path(layer)).register_forward_hook(hook)
    try:
        hf_model(**tokenizer(text, return_tensors="pt"))
    finally:
        handle.remove()
    return captured[0][0, 1:].double().numpy()


def _sae_params(sae: SAEAsset) -> tuple[dict[str, np.ndarray], bool]:
    """Raw arrays and whether the encoder subtracts b_dec, read straight from disk."""
    if sae.layout == "gemmascope":
        with np.load(sae.path / "params.npz", allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}, False
    cfg = json.loads((sae.path / "cfg.json").read_text())
    return load_file(str(sae.path / "sae_weights.safetensors")), cfg["apply_b_dec_to_input"]


def _pre_activations(sae: SAEAsset, acts: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    params, subtract_b_dec = _sae_params(sae)
    x = acts - params["b_dec"] if subtract_b_dec else acts
    return x @ params["W_enc"].astype(np.float64) + params["b_enc"], params


@pytest.fixture(scope="module")
def concurrent_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[AssetManifest, list[str]]:
    """Two processes call ensure_assets on one empty directory at the same time."""
    root = tmp_path_factory.mktemp("concurrent-assets")
    script = textwrap.dedent(
        f"""
        import logging, sys
        from pathlib import Path
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from offline_assets import ensure_assets
        sys.stdout.write(ensure_assets(Path({str(root)!r})).to_json())
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    manifests = [AssetManifest.from_json(out) for out, _err in outputs]
    assert manifests[0] == manifests[1]
    return manifests[0], [err for _out, err in outputs]


def test_manifest_names_the_standard_set(tiny_assets: AssetManifest) -> None:
    assert set(tiny_assets.models) == set(TINY_MODELS)
    assert set(EXPECTED_SAES) <= set(tiny_assets.saes)
    for name, (model_name, layer, layout, activation) in EXPECTED_SAES.items():
        sae = tiny_assets.saes[name]
        assert (sae.model_name, sae.layer, sae.layout, sae.activation) == (
            model_name,
            layer,
            layout,
            activation,
        )
        assert sae.d_sae == 256 and sae.d_in == tiny_assets.models[model_name].hidden_size
    assert tiny_assets.saes["tiny-llama-L2-topk"].k == 8
    assert AssetManifest.from_json(tiny_assets.to_json()) == tiny_assets


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_model_loads_offline_and_generates(tiny_assets: AssetManifest, name: str) -> None:
    asset = tiny_assets.models[name]
    hf_model, tokenizer = _load(asset)
    config = hf_model.config
    assert type(hf_model).__name__ == asset.architecture_class
    assert config.architectures == [asset.architecture_class]
    assert hf_model.dtype == torch.float32
    assert config.num_hidden_layers == asset.num_layers == 4
    assert config.hidden_size == asset.hidden_size == 64
    assert config.vocab_size == asset.vocab_size == len(tokenizer)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim >= 32
    assert config.max_position_embeddings == 512
    assert len(hf_model.get_submodule(asset.layers_path)) == asset.num_layers

    enc = tokenizer("The ocean is", return_tensors="pt")
    out = hf_model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == enc["input_ids"].shape[1] + 8


def test_tokenizer_round_trips_and_formats_chat(tiny_assets: AssetManifest) -> None:
    _model, tokenizer = _load(tiny_assets.models["tiny-llama"])
    assert len(tokenizer) == 512
    text = "Hello, world! The sea is calm today; naïve café owners say 42 € — 😀"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges were learned, not just bytes

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not without.endswith("assistant\n")
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    for token in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) in chat_ids
    assert {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token} == {
        "</s>",
        "<pad>",
        "<s>",
    }


@pytest.mark.parametrize("name", sorted(EXPECTED_SAES))
def test_sae_files_have_exact_layout(tiny_assets: AssetManifest, name: str) -> None:
    sae = tiny_assets.saes[name]
    d_in, d_sae = sae.d_in, sae.d_sae
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,)}
    if sae.activation == "jumprelu":
        shapes["threshold"] = (d_sae,)

    if sae.layout == "gemmascope":
        assert sorted(p.name for p in sae.path.iterdir()) == ["params.npz"]
        with np.load(sae.path / "params.npz", allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    else:
        assert sorted(p.name for p in sae.path.iterdir()) == ["cfg.json", "sae_weights.safetensors"]
        arrays = load_file(str(sae.path / "sae_weights.safetensors"))
        cfg = json.loads((sae.path / "cfg.json").read_text())
        architecture = {"relu": "standard", "jumprelu": "jumprelu", "topk": "topk"}[sae.activation]
        assert cfg["architecture"] == architecture
        assert (cfg["d_in"], cfg["d_sae"]) == (d_in, d_sae)
        assert cfg["hook_name"] == f"blocks.{sae.layer}.hook_resid_post" == sae.hook_name
        assert cfg["hook_layer"] == sae.layer
        assert cfg["model_name"] == sae.model_name
        assert cfg["dtype"] == "float32"
        assert cfg["normalize_activations"] == "none"
        assert isinstance(cfg["apply_b_dec_to_input"], bool)
        if sae.activation == "topk":
            assert cfg["activation_fn_str"] == "topk"
            assert cfg["activation_fn_kwargs"] == {"k": sae.k} and cfg["k"] == sae.k
        else:
            assert cfg["activation_fn_str"] == "relu"
            assert cfg["activation_fn_kwargs"] == {}

    assert {key: arr.shape for key, arr in arrays.items()} == shapes
    assert all(arr.dtype == np.float32 for arr in arrays.values())
    np.testing.assert_allclose(np.linalg.norm(arrays["W_dec"], axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n, spec in EXPECTED_SAES.items() if spec[3] == "jumprelu"])
def test_jumprelu_threshold_decides_on_real_residuals(tiny_assets: AssetManifest, name: str) -> None:
    sae = tiny_assets.saes[name]
    model = tiny_assets.models[sae.model_name]
    hf_model, tokenizer = _load(model)
    pre, params = _pre_activations(sae, _block_output(model, hf_model, tokenizer, sae.layer, HELD_OUT_TEXT))
    threshold = params["threshold"]
    assert (threshold > 0).all()
    passed = pre > threshold
    blocked_positive = (pre > 0) & ~passed
    assert 0.01 < passed.mean() < 0.5, passed.mean()
    assert blocked_positive.mean() > 0.01, "the threshold never blocks a positive pre-activation"
    assert passed.any(axis=0).mean() > 0.25, "most features never pass the threshold"


@pytest.mark.parametrize("name", [n for n, spec in EXPECTED_SAES.items() if spec[3] != "jumprelu"])
def test_relu_and_topk_saes_fire_sparsely_on_real_residuals(tiny_assets: AssetManifest, name: str) -> None:
    sae = tiny_assets.saes[name]
    model = tiny_assets.models[sae.model_name]
    hf_model, tokenizer = _load(model)
    pre, _params = _pre_activations(sae, _block_output(model, hf_model, tokenizer, sae.layer, HELD_OUT_TEXT))
    firing = pre > 0
    assert 0.01 < firing.mean() < 0.5, firing.mean()
    assert firing.any(axis=0).mean() > 0.25, "most features are dead"
    if sae.activation == "topk":
        assert (firing.sum(axis=1) >= sae.k).all(), "top-k would select non-positive values everywhere"


def test_same_seed_gives_identical_bytes_across_concurrent_builds(
    tiny_assets: AssetManifest, concurrent_build: tuple[AssetManifest, list[str]]
) -> None:
    fresh, _logs = concurrent_build
    reference = _digests(tiny_assets.root)
    rebuilt = _digests(fresh.root)
    assert any(name.endswith("model.safetensors") for name in rebuilt)
    assert any(name.endswith("params.npz") for name in rebuilt)
    assert {k: v for k, v in reference.items() if k in rebuilt} == rebuilt
    assert set(rebuilt) <= set(reference)


def test_concurrent_callers_build_once(concurrent_build: tuple[AssetManifest, list[str]]) -> None:
    _manifest, logs = concurrent_build
    assert sum("building tiny test assets" in log for log in logs) == 1


def test_seed_changes_weights_and_not_the_callers_rng(tmp_path: Path) -> None:
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()[1].copy()
    first = build_tiny_model("gpt2", tmp_path / "seed0", seed=0)
    second = build_tiny_model("gpt2", tmp_path / "seed1", seed=1)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state)
    weights = [(path / "model.safetensors").read_bytes() for path in (first, second)]
    assert weights[0] != weights[1]
    tokenizers = [(path / "tokenizer.json").read_bytes() for path in (first, second)]
    assert tokenizers[0] == tokenizers[1]


@pytest.mark.parametrize(("layout", "activation", "k"), [("saelens", "topk", 4), ("gemmascope", "jumprelu", None)])
def test_build_sae_is_deterministic_without_a_model(
    tmp_path: Path, layout: str, activation: str, k: int | None
) -> None:
    kwargs = dict(
        d_in=32,
        d_sae=64,
        layer=0,
        layout=layout,
        activation=activation,
        model_name="m",
        k=k,
        seed=3,
    )
    a = build_sae(tmp_path / "a", **kwargs)
    b = build_sae(tmp_path / "b", **kwargs)
    assert _digests(a) == _digests(b)
    c = build_sae(tmp_path / "c", **{**kwargs, "seed": 4})
    assert _digests(a) != _digests(c)


@pytest.mark.parametrize(
    ("layout", "activation", "k"),
    [
        ("gemmascope", "relu", None),
        ("saelens", "topk", None),
        ("saelens", "relu", 3),
        ("npz", "relu", None),
    ],
)
def test_build_sae_refuses_inconsistent_specs(tmp_path: Path, layout: str, activation: str, k: int | None) -> None:
    with pytest.raises(ValueError):
        build_sae(
            tmp_path,
            d_in=8,
            d_sae=16,
            layer=0,
            layout=layout,
            activation=activation,
            model_name="m",
            k=k,
        )


def test_second_call_reuses_the_cache_and_a_stale_key_rebuilds(
    concurrent_build: tuple[AssetManifest, list[str]],
) -> None:
    manifest, _logs = concurrent_build
    root = manifest.root
    before = _mtimes(root)
    again = ensure_assets(root)
    assert again == manifest
    assert _mtimes(root) == before

    manifest_path = root / MANIFEST_NAME
    payload = json.loads(manifest_path.read_text())
    payload["build_key"]["builder_version"] = "stale"
    manifest_path.write_text(json.dumps(payload))
    digests = _digests(root)
    rebuilt = ensure_assets(root)
    assert rebuilt == manifest
    weights = root / "models" / "tiny-llama" / "model.safetensors"
    assert weights.stat().st_mtime_ns != before[weights.relative_to(root).as_posix()]
    assert _digests(root) == digests


def test_include_demo_without_the_package_falls_back_to_the_tiny_set(
    concurrent_build: tuple[AssetManifest, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import offline_assets.demo as demo

    monkeypatch.setattr(demo, "demo_gguf_path", lambda: None)
    manifest, _logs = concurrent_build
    assert ensure_assets(manifest.root, include_demo=True) == manifest
