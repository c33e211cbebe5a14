"""Memory estimates for a model before it is loaded (torch-free).

estimate = weights at the load precision + the KV cache of TRANSFORMERS_MIN_CONTEXT tokens
(or the model's own window, if shorter). Activations and allocator slack are not included;
a load is judged against free memory with that in mind.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

# Bytes a weight takes at each registry quantization (FP16 also covers bf16).
WEIGHT_BYTES: dict[str, float] = {"FP32": 4.0, "FP16": 2.0, "Q8": 1.0, "Q4": 0.5, "Q2": 0.25}
# The KV cache stays in the compute dtype: fp32 for FP32 models, 16-bit otherwise.
KV_BYTES: dict[str, int] = {"FP32": 4, "FP16": 2, "Q8": 2, "Q4": 2, "Q2": 2}

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers keep the decoder's dimensions in ``text_config``."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        return {**cfg, **text}
    return cfg


def kv_bytes_per_token(cfg: dict[str, Any], quantization: str) -> int:
    cfg = text_config(cfg)
    layers = int(_first(cfg, _LAYER_KEYS) or 0)
    hidden = int(_first(cfg, _HIDDEN_KEYS) or 0)
    heads = int(_first(cfg, _HEAD_KEYS) or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    return 2 * layers * kv_heads * head_dim * KV_BYTES.get(quantization, 2)


def context_length(cfg: dict[str, Any]) -> int | None:
    value = _first(text_config(cfg), _CONTEXT_KEYS)
    return int(value) if value else None


def estimate_bytes(*, parameter_count: int, config: dict[str, Any], quantization: str) -> int:
    window = context_length(config) or settings.TRANSFORMERS_MIN_CONTEXT
    reserve = min(window, settings.TRANSFORMERS_MIN_CONTEXT)
    weights = parameter_count * WEIGHT_BYTES.get(quantization, 4.0)
    return int(weights + kv_bytes_per_token(config, quantization) * reserve)


def estimates_by_quantization(*, parameter_count: int, config: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per quantization: weights on disk as published are not changed by the choice (the
    download stores the checkpoint as is); memory is what a load at that precision needs."""
    return {
        quant: {
            "memory_mb": round(
                estimate_bytes(parameter_count=parameter_count, config=config, quantization=quant) / 2**20, 3
            ),
            "weights_mb": round(parameter_count * per_param / 2**20, 3),
        }
        for quant, per_param in WEIGHT_BYTES.items()
    }


def format_params(count: int | None) -> str | None:
    """2_614_341_888 -> "2.6B" (the documented ``params`` field)."""
    if not count:
        return None
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(count)
