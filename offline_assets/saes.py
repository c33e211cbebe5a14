"""Random SAEs in the two on-disk layouts the engine loads (SAELens and Gemma Scope).

Random weights alone would leave almost every feature dead or always on, which makes
monitoring tests vacuous. So encoder biases (and JumpReLU thresholds) are calibrated on
a sample of real inputs: each feature fires on its own fraction of the sample, and for
JumpReLU a band of positive pre-activations is deliberately kept below the threshold so
that the threshold, not the ReLU, decides.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

LAYOUTS = ("saelens", "gemmascope")
ACTIVATIONS = ("relu", "jumprelu", "topk")
SAELENS_ARCHITECTURE = {"relu": "standard", "jumprelu": "jumprelu", "topk": "topk"}
SAELENS_CFG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
GEMMASCOPE_PARAMS = "params.npz"
FEATURE_LABELS = "feature_labels.json"
CALIBRATION_SAMPLES = 2048
MIN_FIRE_FRACTION = 0.02
MAX_FIRE_FRACTION = 0.3


def hook_name(layer: int) -> str:
    """The TransformerLens/SAELens name of the residual stream after block ``layer``."""
    return f"blocks.{layer}.hook_resid_post"


def applies_b_dec_to_input(layout: str, activation: str) -> bool:
    """Whether the encoder subtracts ``b_dec`` first.

    Gemma Scope never does, and SAELens ports of JumpReLU SAEs do not either; the other
    tiny SAEs do, so loaders are tested on both settings of the flag.
    """
    return layout == "saelens" and activation != "jumprelu"


def _validate(*, d_in: int, d_sae: int, layer: int, layout: str, activation: str, k: int | None) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown SAE layout {layout!r}; expected one of {LAYOUTS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown SAE activation {activation!r}; expected one of {ACTIVATIONS}")
    if layout == "gemmascope" and activation != "jumprelu":
        raise ValueError("the Gemma Scope layout only holds JumpReLU SAEs")
    if activation == "topk":
        if k is None or not 1 <= k <= d_sae:
            raise ValueError(f"a topk SAE needs 1 <= k <= d_sae, got k={k!r}")
    elif k is not None:
        raise ValueError(f"k only applies to topk SAEs, not {activation!r}")
    if d_in < 1 or d_sae < 1 or layer < 0:
        raise ValueError(f"invalid SAE shape d_in={d_in}, d_sae={d_sae}, layer={layer}")


def random_sae_weights(
    rng: np.random.Generator,
    *,
    d_in: int,
    d_sae: int,
    activation: str,
    apply_b_dec_to_input: bool,
    calibration: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Random unit decoder rows, a matching encoder, and calibrated biases/thresholds.

    The encoder column of feature j is its decoder row divided by the spread of the
    sample's projection on it, so pre-activations have unit scale whatever the model's
    residual norm is, and steering along a feature raises that same feature.
    """
    if calibration is None:
        calibration = rng.standard_normal((CALIBRATION_SAMPLES, d_in))
    x = np.asarray(calibration, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(f"calibration must have shape (n, {d_in}), got {x.shape}")

    b_dec = x.mean(axis=0)
    w_dec = rng.standard_normal((d_sae, d_in))
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    encoder_in = x - b_dec if apply_b_dec_to_input else x
    proj = encoder_in @ w_dec.T
    spread = proj.std(axis=0) + 1e-6
    w_enc = w_dec.T / spread
    proj /= spread

    fire = rng.uniform(MIN_FIRE_FRACTION, MAX_FIRE_FRACTION, size=d_sae)
    positive = 2 * fire if activation == "jumprelu" else fire
    b_enc = -np.array([np.quantile(proj[:, j], 1.0 - positive[j]) for j in range(d_sae)])
    weights = {
        "W_enc": w_enc.astype(np.float32),
        "W_dec": w_dec.astype(np.float32),
        "b_enc": b_enc.astype(np.float32),
        "b_dec": b_dec.astype(np.float32),
    }
    if activation == "jumprelu":
        pre = proj + b_enc
        threshold = np.array([np.quantile(pre[:, j], 1.0 - fire[j]) for j in range(d_sae)])
        weights["threshold"] = np.maximum(threshold, 1e-3).astype(np.float32)
    return weights


def saelens_config(
    *,
    d_in: int,
    d_sae: int,
    layer: int,
    activation: str,
    model_name: str,
    k: int | None,
    apply_b_dec_to_input: bool,
) -> dict[str, Any]:
    """A SAELens ``cfg.json``: the flat pre-6.0 keys plus the 6.x ``k``/``metadata`` keys.

    Writing both spellings means a loader that handles the aliases real SAELens repos
    use is exercised on one file.
    """
    cfg: dict[str, Any] = {
        "architecture": SAELENS_ARCHITECTURE[activation],
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "device": "cpu",
        "model_name": model_name,
        "hook_name": hook_name(layer),
        "hook_layer": layer,
        "hook_head_index": None,
        "activation_fn_str": "topk" if activation == "topk" else "relu",
        "activation_fn_kwargs": {"k": k} if activation == "topk" else {},
        "apply_b_dec_to_input": apply_b_dec_to_input,
        "finetuning_scaling_factor": False,
        "normalize_activations": "none",
        "context_size": 128,
        "prepend_bos": True,
        "dataset_path": "",
        "sae_lens_training_version": None,
        "metadata": {
            "model_name": model_name,
            "hook_name": hook_name(layer),
            "hook_head_index": None,
            "prepend_bos": True,
            "context_size": 128,
        },
    }
    if activation == "topk":
        cfg["k"] = k
    return cfg


def save_npz_deterministic(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write an uncompressed ``.npz`` whose bytes depend only on the arrays.

    ``np.savez`` stamps each zip member with the current time, so two identical builds
    would differ byte for byte; a fixed timestamp and sorted member order make them equal.
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, buffer.getvalue())


def write_sae(
    out_dir: Path,
    weights: Mapping[str, np.ndarray],
    *,
    layer: int,
    layout: str,
    activation: str,
    model_name: str,
    k: int | None = None,
    feature_labels: Mapping[int, str] | None = None,
) -> Path:
    """Write already-computed weights in ``layout``; shared by the random and demo SAEs."""
    d_in, d_sae = weights["W_enc"].shape
    _validate(d_in=d_in, d_sae=d_sae, layer=layer, layout=layout, activation=activation, k=k)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout == "saelens":
        cfg = saelens_config(
            d_in=d_in,
            d_sae=d_sae,
            layer=layer,
            activation=activation,
            model_name=model_name,
            k=k,
            apply_b_dec_to_input=applies_b_dec_to_input(layout, activation),
        )
        (out_dir / SAELENS_CFG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(
            {name: np.ascontiguousarray(arr) for name, arr in weights.items()},
            str(out_dir / SAELENS_WEIGHTS),
        )
    else:
        save_npz_deterministic(out_dir / GEMMASCOPE_PARAMS, weights)
    if feature_labels:
        labels = {str(index): label for index, label in sorted(feature_labels.items())}
        (out_dir / FEATURE_LABELS).write_text(json.dumps(labels, indent=2) + "\n")
    return out_dir


def build_sae(
    out_dir: Path,
    *,
    d_in: int,
    d_sae: int,
    layer: int,
    layout: str,
    activation: str,
    model_name: str,
    k: int | None = None,
    seed: int = 0,
    calibration: np.ndarray | None = None,
) -> Path:
    """Build a random SAE for the residual stream after block ``layer`` and save it.

    ``calibration`` is a sample (n, d_in) of that residual stream; without it the SAE is
    calibrated for standard-normal inputs. Returns ``out_dir``, which holds ``cfg.json``
    + ``sae_weights.safetensors`` (SAELens) or ``params.npz`` (Gemma Scope).
    """
    _validate(d_in=d_in, d_sae=d_sae, layer=layer, layout=layout, activation=activation, k=k)
    weights = random_sae_weights(
        np.random.default_rng(seed),
        d_in=d_in,
        d_sae=d_sae,
        activation=activation,
        apply_b_dec_to_input=applies_b_dec_to_input(layout, activation),
        calibration=calibration,
    )
    return write_sae(
        out_dir,
        weights,
        layer=layer,
        layout=layout,
        activation=activation,
        model_name=model_name,
        k=k,
    )
