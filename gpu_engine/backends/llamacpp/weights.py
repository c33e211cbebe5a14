"""What a loaded GGUF's weights are and take (``EngineStatus.weights``), read from the
file with the ``gguf`` package (its tensor table only: no tensor data is read) and from
llama.cpp itself (``llama_model_size``: the bytes of the tensors it holds, on the host or
offloaded).

The meaning is the transformers backend's: ``quantization`` is a quantization applied at
load (llama.cpp applies none: null), ``checkpoint_quantization`` the file's own
(``general.file_type``: ``Q4_0``, ``Q8_0``, ``Q4_K_M``…; null for an F32/F16/BF16 file),
``bytes`` what the resident weights take, ``bytes_by_dtype`` per GGML tensor type (``F32``,
``Q4_0``…: a quantized file keeps its norms and often its embeddings in F32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

UNQUANTIZED = {"ALL_F32": None, "MOSTLY_F16": None, "MOSTLY_BF16": None}


def file_type_name(value: str | int | None) -> str | None:
    """``general.file_type`` as its llama.cpp name without ``MOSTLY_`` (null: not quantized,
    or not said)."""
    if value in (None, ""):
        return None
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(value)).name
    except ValueError:
        return f"file_type {value}"
    if name in UNQUANTIZED:
        return None
    return name.removeprefix("MOSTLY_")


def gguf_weights(path: str | Path, file_type: str | int | None, held_bytes: int | None) -> dict[str, Any]:
    from gguf import GGUFReader

    by_type: dict[str, int] = {}
    try:
        for tensor in GGUFReader(str(path)).tensors:
            name = tensor.tensor_type.name
            by_type[name] = by_type.get(name, 0) + int(tensor.n_bytes)
    except Exception:  # noqa: BLE001 - llama.cpp read the file; a table gguf cannot read costs the breakdown only
        by_type = {}
    return {
        "quantization": None,
        "checkpoint_quantization": file_type_name(file_type),
        "bytes": int(held_bytes) if held_bytes is not None else sum(by_type.values()),
        "bytes_by_dtype": by_type,
    }


__all__ = ["file_type_name", "gguf_weights"]
