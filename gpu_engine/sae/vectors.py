"""Raw steering vectors (a direction per layer, not from an SAE) as the layout ``vector``.

The file (docs/steering.md, "Raw steering vectors") is one safetensors file holding one
1-D floating-point tensor per layer, named ``layer.<L>`` (``layer.12``), all of the same
length ``d_model``.  Its string metadata may say ``model_name`` and ``hook_point``
(default ``resid_post``); anything else there is kept but not read.

Attached at layer L, the file is an SAE with no encoder whose one decoder row is
``layer.<L>`` (``d_sae = 1``, feature 0), so the steering machinery serves it unchanged:
``features={0: s}`` adds ``s · v`` at every position and ``ablate`` removes the
direction ``v / ‖v‖``.  What needs an encoder (monitoring, clamp, scale, conditions) is
refused in ``gpu_engine.runtime.prepare``.  A layer the file has no vector for is refused at
attach (``sae_incompatible`` naming the layer).

Only safetensors is read: nothing is unpickled.  The readers here use numpy, never
torch, so the web tier can check and write vector files without importing torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..api.errors import ModelLoadFailed, SAEFormatError, SAEIncompatible
from ..api.model_dir import read_safetensors_header
from .config import SAEConfig
from .hookpoints import DEFAULT_HOOK_POINT
from .layouts import SAELayout, register_layout

if TYPE_CHECKING:  # pragma: no cover
    import torch

LAYOUT = "vector"
# the name of the file in a directory we write (``<cache>/vectors/<id>/vector.safetensors``)
VECTOR_FILE = "vector.safetensors"
TENSOR_NAME = re.compile(r"^layer\.(0|[1-9][0-9]{0,5})$")
# no BF16: numpy (what the web tier reads with) has no bfloat16
FLOAT_DTYPES = ("F16", "F32", "F64")
# where a vector may be added (a transcoder's read-here-write-there makes no sense for one)
VECTOR_HOOK_POINTS = ("resid_post", "resid_pre", "attn_out", "mlp_out")


def tensor_name(layer: int) -> str:
    return f"layer.{int(layer)}"


@dataclass(frozen=True)
class VectorFile:
    """A vector file's header, checked: no tensor data read."""

    path: str
    d_model: int
    layers: tuple[int, ...]  # ascending
    metadata: dict[str, str]

    @property
    def hook_point(self) -> str:
        return self.metadata.get("hook_point") or DEFAULT_HOOK_POINT


def read_vector_header(path: str | Path) -> VectorFile:
    """The checked header of a vector file, or ``SAEFormatError`` saying what is wrong."""
    p = Path(path)
    if p.is_dir():
        p = p / VECTOR_FILE
    source = str(p)
    try:
        header = read_safetensors_header(p)
    except ModelLoadFailed as exc:
        raise SAEFormatError(f"not a safetensors file: {exc.message}", details={"path": source}) from exc
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SAEFormatError("the safetensors metadata is not a map of strings", details={"path": source})
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise SAEFormatError(
            "the file holds no tensor; expected one layer.<L> tensor per layer", details={"path": source}
        )
    layers: dict[int, int] = {}
    for name, info in tensors.items():
        match = TENSOR_NAME.match(name)
        if match is None:
            raise SAEFormatError(
                f"tensor {name!r} is not named layer.<L>; a vector file holds one layer.<L> tensor per layer",
                details={"path": source, "tensor": name},
            )
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if dtype not in FLOAT_DTYPES:
            raise SAEFormatError(
                f"tensor {name} has dtype {dtype}; expected one of {', '.join(FLOAT_DTYPES)}",
                details={"path": source, "tensor": name},
            )
        if not isinstance(shape, list) or len(shape) != 1 or not isinstance(shape[0], int) or shape[0] <= 0:
            raise SAEFormatError(
                f"tensor {name} has shape {shape}; expected [d_model]", details={"path": source, "tensor": name}
            )
        layers[int(match.group(1))] = shape[0]
    widths = set(layers.values())
    if len(widths) != 1:
        raise SAEFormatError(f"the vectors have different lengths ({sorted(widths)})", details={"path": source})
    hook_point = meta.get("hook_point") or DEFAULT_HOOK_POINT
    if hook_point not in VECTOR_HOOK_POINTS:
        raise SAEFormatError(
            f"hook_point {hook_point!r} in the metadata is not one of {', '.join(VECTOR_HOOK_POINTS)}",
            details={"path": source},
        )
    return VectorFile(source, widths.pop(), tuple(sorted(layers)), dict(meta))


def read_vectors(path: str | Path) -> dict[int, np.ndarray]:
    """Every vector of a checked file as float32 numpy arrays, by layer (no torch)."""
    from ..api.archives import ArchiveRefused, read_safetensors

    info = read_vector_header(path)
    try:  # checked from its header first: never more than the layers' vectors it declares
        raw = read_safetensors(info.path, max_bytes=len(info.layers) * info.d_model * 8)
    except ArchiveRefused as exc:
        raise SAEFormatError(
            f"cannot read the vectors: {exc.message}", details={"path": info.path, **exc.details}
        ) from exc
    out = {}
    for layer in info.layers:
        v = np.asarray(raw[tensor_name(layer)], dtype=np.float32)
        if not np.isfinite(v).all():
            raise SAEFormatError(
                f"the vector of layer {layer} contains NaN or Inf", details={"path": info.path, "layer": layer}
            )
        out[layer] = v
    return out


def write_vector_file(path: str | Path, vectors: Mapping[int, Any], metadata: Mapping[str, str]) -> Path:
    """Write ``vectors`` (layer -> 1-D array) as a vector file (float32) at ``path``."""
    from safetensors.numpy import save_file

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        tensor_name(layer): np.ascontiguousarray(np.asarray(v, dtype=np.float32).reshape(-1))
        for layer, v in sorted(vectors.items())
    }
    save_file(tensors, str(p), metadata={str(k): str(v) for k, v in metadata.items()})
    return p


# ----------------------------------------------------------------------------- the layout


def _detect(p: Path) -> Path | None:
    if p.is_dir():
        p = p / VECTOR_FILE
        if not p.is_file():
            return None
    elif p.suffix != ".safetensors" or p.name == "sae_weights.safetensors":
        return None
    try:
        header = read_safetensors_header(p)
    except ModelLoadFailed:
        return None
    names = [k for k in header if k != "__metadata__"]
    return p if names and all(TENSOR_NAME.match(k) for k in names) else None


def _metadata(path: Path) -> SAEConfig:
    info = read_vector_header(path)
    model_name = info.metadata.get("model_name") or None
    return SAEConfig(
        d_in=info.d_model,
        d_sae=1,
        activation="none",
        layout=LAYOUT,
        path=info.path,
        model_name=model_name,
        layer=info.layers[0] if len(info.layers) == 1 else None,
        hook_point=info.hook_point,
        weights_file=info.path,
        has_encoder=False,
        extra={"layers": list(info.layers)},
    )


def _for_layer(cfg: SAEConfig, layer: int) -> SAEConfig:
    layers = list(cfg.extra.get("layers") or [])
    if layer not in layers:
        raise SAEIncompatible(
            f"the steering vector file has no vector for layer {layer} (it has layers {layers})",
            details={"layer": layer, "layers": layers},
        )
    return replace(cfg, layer=layer)


def _load(cfg: SAEConfig) -> dict[str, torch.Tensor]:
    import torch

    if cfg.layer is None:
        raise SAEFormatError("a steering vector loads for one layer; none was chosen", details={"path": cfg.path})
    v = torch.from_numpy(read_vectors(cfg.weights_file)[cfg.layer])
    return {"W_dec": v.reshape(1, -1), "b_dec": torch.zeros_like(v)}


register_layout(SAELayout(LAYOUT, _detect, _metadata, _load, for_layer=_for_layer))


__all__ = [
    "LAYOUT",
    "VECTOR_FILE",
    "VectorFile",
    "read_vector_header",
    "read_vectors",
    "tensor_name",
    "write_vector_file",
]
