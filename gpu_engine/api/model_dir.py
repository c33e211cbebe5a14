"""Describe a local transformers checkpoint without loading its weights.

Reads ``config.json`` and the safetensors headers (8-byte length + JSON), so it is cheap
enough for the web tier's model preview and imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .architectures import is_supported_architecture
from .errors import InvalidParameter, ModelLoadFailed

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


# Context reserved for the memory estimate when the caller gives none: the documented
# TRANSFORMERS_MIN_CONTEXT default, or the model's own window if that is shorter.
DEFAULT_ESTIMATE_CONTEXT = 4096

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class ModelInfo:
    architecture_class: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int
    param_count: int
    disk_size_bytes: int
    estimated_memory_bytes: int
    dtype: str = "float32"
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    weights_bytes: int = 0
    kv_cache_bytes_per_token: int = 0
    estimate_context_tokens: int = 0
    tie_word_embeddings: bool = False
    has_chat_template: bool = False
    requires_remote_code: bool = False
    supported: bool = True
    weight_files: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Return the JSON header of a safetensors file (tensor name -> dtype/shape/offsets)."""
    try:
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw_len)
            if n <= 0 or n > 100_000_000:
                raise ValueError(f"implausible header length {n}")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        raise ModelLoadFailed(
            f"Cannot read safetensors header of {path.name}: {exc}", details={"path": str(path)}
        ) from exc
    if not isinstance(header, dict):
        raise ModelLoadFailed(f"Malformed safetensors header in {path.name}", details={"path": str(path)})
    return header


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({root / name for name in weight_map.values()})
    return sorted(root.glob("*.safetensors"))


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (Gemma3ForConditionalGeneration, …) keep the decoder's
    # dimensions in a nested text_config.
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        for key, value in cfg.items():
            merged.setdefault(key, value)
        return merged
    return cfg


def inspect_model_dir(path: str | Path, dtype: str = "float32", *, context_tokens: int | None = None) -> ModelInfo:
    """Read what the web tier needs to list, preview and size a model directory.

    ``estimated_memory_bytes`` = weights at ``dtype`` + KV cache for ``context_tokens``
    (default: min(context_length, 4096)).  Activations and allocator slack are not
    included; the caller adds its own margin.
    """
    root = Path(path)
    if dtype not in DTYPE_BYTES:
        raise InvalidParameter(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}", param="dtype")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadFailed(f"No config.json in {root}", details={"path": str(root)})
    try:
        raw_cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ModelLoadFailed(f"config.json in {root} is not valid JSON: {exc}", details={"path": str(root)}) from exc
    cfg = _text_config(raw_cfg)

    architectures = raw_cfg.get("architectures") or []
    architecture_class = str(architectures[0]) if architectures else ""
    model_type = str(raw_cfg.get("model_type") or "")
    num_layers = int(_first(cfg, _LAYER_KEYS) or 0)
    hidden_size = int(_first(cfg, _HIDDEN_KEYS) or 0)
    vocab_size = int(cfg.get("vocab_size") or 0)
    context_length = int(_first(cfg, _CONTEXT_KEYS) or 0)
    heads = int(_first(cfg, _HEAD_KEYS) or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or cfg.get("multi_query_group_num") or heads)
    head_dim = int(cfg.get("head_dim") or (hidden_size // heads if heads else 0))

    files = _weight_files(root)
    if not files:
        raise ModelLoadFailed(f"No safetensors weights in {root}", details={"path": str(root)})
    param_count = 0
    for file in files:
        header = read_safetensors_header(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            param_count += math.prod(int(d) for d in info.get("shape", []))
    disk_size = sum(f.stat().st_size for f in files if f.exists())

    weights_bytes = param_count * DTYPE_BYTES[dtype]
    kv_per_token = 2 * num_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
    window = context_length or DEFAULT_ESTIMATE_CONTEXT
    reserve = context_tokens if context_tokens is not None else min(window, DEFAULT_ESTIMATE_CONTEXT)

    has_template = False
    tok_cfg = root / "tokenizer_config.json"
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        has_template = True
    elif tok_cfg.is_file():
        try:
            has_template = bool(json.loads(tok_cfg.read_text()).get("chat_template"))
        except ValueError:
            has_template = False

    return ModelInfo(
        architecture_class=architecture_class,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        context_length=context_length,
        param_count=param_count,
        disk_size_bytes=disk_size,
        estimated_memory_bytes=weights_bytes + kv_per_token * reserve,
        dtype=dtype,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        weights_bytes=weights_bytes,
        kv_cache_bytes_per_token=kv_per_token,
        estimate_context_tokens=reserve,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        has_chat_template=has_template,
        requires_remote_code=bool(raw_cfg.get("auto_map")),
        supported=is_supported_architecture(architecture_class),
        weight_files=[f.name for f in files],
    )


__all__ = ["DTYPE_BYTES", "ModelInfo", "inspect_model_dir", "read_safetensors_header"]
