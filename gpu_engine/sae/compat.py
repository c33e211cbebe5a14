"""Can this SAE be attached to that model at that layer?  (no torch)

Errors make attaching impossible (d_in differs from the hidden size, layer out of range);
warnings flag an SAE trained somewhere else (another layer or model), which attaching
allows because researchers do transfer SAEs on purpose.
"""

from __future__ import annotations

from ..api.results import CompatibilityReport
from .config import SAEConfig


def _norm_model_name(name: str) -> str:
    return name.strip().rstrip("/").split("/")[-1].lower()


def check_compatibility(
    cfg: SAEConfig,
    *,
    hidden_size: int,
    num_layers: int,
    layer: int,
    model_name: str | None = None,
) -> CompatibilityReport:
    errors: list[str] = []
    warnings: list[str] = []
    if cfg.d_in != hidden_size:
        errors.append(f"SAE d_in={cfg.d_in} does not match the model hidden size {hidden_size}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        errors.append(f"layer {layer} is out of range for a model with {num_layers} layers (0..{num_layers - 1})")
    elif cfg.layer is not None and cfg.layer != layer:
        warnings.append(f"SAE was trained on layer {cfg.layer}, attaching at layer {layer}")
    if cfg.model_name and model_name and _norm_model_name(cfg.model_name) != _norm_model_name(model_name):
        warnings.append(f"SAE was trained on model {cfg.model_name!r}, the loaded model is {model_name!r}")
    if cfg.normalize_activations == "expected_average_only_in" and cfg.norm_scaling_factor is None:
        warnings.append(
            "SAE was trained with expected_average_only_in normalisation but its files give no norm_scaling_factor: "
            "inputs are encoded unscaled, as SAELens's load_from_disk does"
        )
    return CompatibilityReport(compatible=not errors, errors=errors, warnings=warnings)


__all__ = ["check_compatibility"]
