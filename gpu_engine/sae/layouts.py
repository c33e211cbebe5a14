"""SAE file layouts behind one registry.

Each layout knows how to recognise a path, read its metadata cheaply (config + tensor
shapes, no weights) and load its tensors.  ``register_layout`` refuses duplicate names so a
plug-in cannot silently replace a loader.  Torch is imported only inside ``load_tensors``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..api.archives import ArchiveRefused, npz_members, read_npz, read_safetensors
from ..api.errors import ModelLoadFailed, SAEFormatError
from ..api.model_dir import read_safetensors_header
from .config import SAEConfig
from .hookpoints import parse_hook_point

if TYPE_CHECKING:  # pragma: no cover
    import torch

# reading shapes only (nothing inflated): the largest SAE file a header may describe
NPZ_HEADER_SCAN_MAX_BYTES = 64 << 30
CONFIG_NAMES = ("cfg.json", "config.json", "sae_cfg.json", "sae_config.json")
D_IN_KEYS = ("d_in", "d_model", "input_dim", "activation_dim")
D_SAE_KEYS = ("d_sae", "d_hidden", "dict_size", "num_features")

# canonical tensor name -> accepted names, each with the orientation it is stored in
# ("in_sae": rows are the input dim, "sae_in": rows are the dictionary).
_TENSOR_ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "W_enc": (("W_enc", "in_sae"), ("encoder.weight", "sae_in")),
    "W_dec": (("W_dec", "sae_in"), ("decoder.weight", "in_sae")),
    "b_enc": (("b_enc", ""), ("encoder.bias", "")),
    "b_dec": (("b_dec", ""), ("decoder.bias", ""), ("bias", "")),
    "threshold": (("threshold", ""), ("log_threshold", "log")),
    # gated SAEs (SAELens ``GatedSAE``): no b_enc; a gate bias, a magnitude bias and a
    # per-feature log scale of the shared encoder
    "b_gate": (("b_gate", ""),),
    "b_mag": (("b_mag", ""),),
    "r_mag": (("r_mag", ""),),
}
_GATED = ("b_gate", "b_mag", "r_mag")


@dataclass(frozen=True)
class SAELayout:
    name: str
    detect: Callable[[Path], Path | None]  # returns the SAE directory/file it recognises
    read_metadata: Callable[[Path], SAEConfig]
    load_tensors: Callable[[SAEConfig], dict[str, torch.Tensor]]
    # a layout whose file holds one entry per layer (raw steering vectors) narrows its
    # config to the layer it is attached at, refusing a layer the file lacks
    for_layer: Callable[[SAEConfig, int], SAEConfig] | None = None


_LAYOUTS: dict[str, SAELayout] = {}


def register_layout(layout: SAELayout) -> None:
    if layout.name in _LAYOUTS:
        raise ValueError(f"SAE layout {layout.name!r} is already registered")
    _LAYOUTS[layout.name] = layout


def registered_layouts() -> tuple[str, ...]:
    return tuple(_LAYOUTS)


def get_layout(name: str) -> SAELayout:
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise SAEFormatError(f"Unknown SAE layout {name!r}; known: {', '.join(_LAYOUTS)}") from None


def config_at_layer(layout: SAELayout, cfg: SAEConfig, layer: int) -> SAEConfig:
    """``cfg`` as attached at ``layer`` (unchanged for a layout with one entry per file)."""
    return layout.for_layer(cfg, layer) if layout.for_layer is not None else cfg


def detect_layout(path: str | Path) -> tuple[SAELayout, Path]:
    p = Path(path)
    if not p.exists():
        raise SAEFormatError(f"SAE path {p} does not exist", details={"path": str(p)})
    for layout in _LAYOUTS.values():
        found = layout.detect(p)
        if found is not None:
            return layout, found
    raise SAEFormatError(
        f"No known SAE layout at {p}: expected SAELens ({' | '.join(CONFIG_NAMES)} + "
        "sae_weights.safetensors), Gemma Scope (params.npz) or a steering vector file "
        "(safetensors of layer.<L> tensors)",
        details={"path": str(p)},
    )


def resolve_layout(path: str | Path, layout: str | None = None) -> tuple[SAELayout, Path]:
    """The layout of the SAE at ``path`` and what it recognised there: the named one (which
    must recognise it), else the first registered layout that does."""
    if layout is None:
        return detect_layout(path)
    found_layout = get_layout(layout)
    found = found_layout.detect(Path(path))
    if found is None:
        raise SAEFormatError(f"{path} is not a {layout} SAE", details={"path": str(path)})
    return found_layout, found


def read_sae_metadata(path: str | Path, layout: str | None = None) -> SAEConfig:
    """d_in, d_sae, activation, layout, trained-on model/layer, hook name, k — no weights loaded."""
    found_layout, found = resolve_layout(path, layout)
    return found_layout.read_metadata(found)


def _first(cfg: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


_LAYER_PATTERNS = (
    re.compile(r"blocks\.(\d+)\."),
    re.compile(r"layers\.(\d+)"),
    re.compile(r"\.h\.(\d+)"),
    re.compile(r"layer[_.-]?(\d+)"),
)


def _layer_from_text(text: str | None) -> int | None:
    if not text:
        return None
    for pattern in _LAYER_PATTERNS:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def _resolve_shapes(shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, tuple[str, str]]:
    """Map canonical names -> (stored name, orientation tag) for the tensors present."""
    found: dict[str, tuple[str, str]] = {}
    for canonical, aliases in _TENSOR_ALIASES.items():
        for stored, tag in aliases:
            if stored in shapes:
                found[canonical] = (stored, tag)
                break
    gated = all(name in found for name in _GATED)
    for required in ("W_enc", "W_dec", *(() if gated else ("b_enc",))):
        if required not in found:
            raise SAEFormatError(
                f"SAE weights in {source} lack {required} (have: {', '.join(sorted(shapes)) or 'nothing'})",
                details={"path": source, "missing": required},
            )
    return found


def _dims_from_shapes(
    shapes: dict[str, tuple[int, ...]], names: dict[str, tuple[str, str]], source: str
) -> tuple[int, int]:
    stored, tag = names["W_enc"]
    shape = shapes[stored]
    if len(shape) != 2:
        raise SAEFormatError(f"{stored} in {source} is not a matrix (shape {list(shape)})", details={"path": source})
    return (shape[0], shape[1]) if tag == "in_sae" else (shape[1], shape[0])


def _check_shapes(
    cfg_dims: tuple[int, int], shapes: dict[str, tuple[int, ...]], names: dict[str, tuple[str, str]], source: str
) -> None:
    d_in, d_sae = cfg_dims
    for canonical in ("W_enc", "W_dec"):
        stored, _ = names[canonical]
        shape = tuple(shapes[stored])
        if sorted(shape) != sorted((d_in, d_sae)) or len(shape) != 2:
            raise SAEFormatError(
                f"{stored} in {source} has shape {list(shape)}, expected {d_in}x{d_sae} in either orientation",
                details={"path": source, "tensor": stored, "shape": list(shape)},
            )
    expected = {"b_enc": d_sae, "b_dec": d_in, "threshold": d_sae, "b_gate": d_sae, "b_mag": d_sae, "r_mag": d_sae}
    for canonical, size in expected.items():
        if canonical in names:
            stored, _ = names[canonical]
            if tuple(shapes[stored]) != (size,):
                raise SAEFormatError(
                    f"{stored} in {source} has shape {list(shapes[stored])}, expected [{size}]",
                    details={"path": source, "tensor": stored},
                )


def orient(name: str, tensor: torch.Tensor, d_in: int, d_sae: int, tag: str) -> torch.Tensor:
    """Return ``tensor`` as (d_in, d_sae) for W_enc and (d_sae, d_in) for W_dec."""
    target = (d_in, d_sae) if name == "W_enc" else (d_sae, d_in)
    shape = tuple(tensor.shape)
    if d_in == d_sae:
        # square: only the naming convention can tell
        natural = "in_sae" if name == "W_enc" else "sae_in"
        return tensor if tag == natural else tensor.T.contiguous()
    if shape == target:
        return tensor
    if shape == target[::-1]:
        return tensor.T.contiguous()
    raise SAEFormatError(f"{name} has shape {list(shape)}, expected {list(target)}")


def canonical_tensors(raw: dict[str, torch.Tensor], cfg: SAEConfig) -> dict[str, torch.Tensor]:
    import torch

    shapes = {k: tuple(v.shape) for k, v in raw.items()}
    names = _resolve_shapes(shapes, cfg.path)
    _check_shapes((cfg.d_in, cfg.d_sae), shapes, names, cfg.path)
    out: dict[str, torch.Tensor] = {}
    for canonical, (stored, tag) in names.items():
        t = raw[stored]
        if not torch.is_floating_point(t):
            raise SAEFormatError(f"{stored} in {cfg.path} is not a floating-point tensor", details={"path": cfg.path})
        if canonical in ("W_enc", "W_dec"):
            t = orient(canonical, t, cfg.d_in, cfg.d_sae, tag)
        elif canonical == "threshold" and tag == "log":
            t = t.exp()
        out[canonical] = t
    if "b_dec" not in out:
        out["b_dec"] = torch.zeros(cfg.d_in, dtype=out["W_dec"].dtype)
    if cfg.activation == "jumprelu" and "threshold" not in out:
        raise SAEFormatError(f"JumpReLU SAE at {cfg.path} has no threshold tensor", details={"path": cfg.path})
    if cfg.activation == "gated":
        missing = [name for name in _GATED if name not in out]
        if missing:
            raise SAEFormatError(f"Gated SAE at {cfg.path} lacks {', '.join(missing)}", details={"path": cfg.path})
    elif "b_enc" not in out:
        raise SAEFormatError(f"SAE weights in {cfg.path} lack b_enc", details={"path": cfg.path, "missing": "b_enc"})
    for name, t in out.items():
        if not torch.isfinite(t).all():
            raise SAEFormatError(
                f"{name} in {cfg.path} contains NaN or Inf", details={"path": cfg.path, "tensor": name}
            )
    return out


# ----------------------------------------------------------------------------- SAELens


def _saelens_detect(p: Path) -> Path | None:
    directory = p.parent if p.is_file() else p
    if p.is_file() and p.suffix not in (".safetensors", ".json"):
        return None
    if not (directory / "sae_weights.safetensors").exists():
        return None
    if not any((directory / name).is_file() for name in CONFIG_NAMES):
        return None
    return directory


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SAEFormatError(f"Cannot read SAE config {path}: {exc}", details={"path": str(path)}) from exc
    if not isinstance(data, dict):
        raise SAEFormatError(f"SAE config {path} is not a JSON object", details={"path": str(path)})
    return data


# SAELens transcoder architectures -> the encoder they use
_TRANSCODER_ARCHITECTURES = {"transcoder": "standard", "jumprelu_transcoder": "jumprelu"}


def _saelens_metadata(directory: Path) -> SAEConfig:
    cfg_file = next(directory / n for n in CONFIG_NAMES if (directory / n).is_file())
    cfg = _read_json(cfg_file)
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    weights = directory / "sae_weights.safetensors"
    try:
        header = read_safetensors_header(weights)
    except ModelLoadFailed as exc:
        raise SAEFormatError(
            f"Corrupt SAE weights file {weights}: {exc.message}", details={"path": str(weights)}
        ) from exc
    shapes = {k: tuple(int(d) for d in v.get("shape", [])) for k, v in header.items() if k != "__metadata__"}
    names = _resolve_shapes(shapes, str(weights))
    shape_dims = _dims_from_shapes(shapes, names, str(weights))

    d_in = _first(cfg, D_IN_KEYS)
    d_sae = _first(cfg, D_SAE_KEYS)
    d_in = int(d_in) if d_in is not None else shape_dims[0]
    d_sae = int(d_sae) if d_sae is not None else shape_dims[1]
    _check_shapes((d_in, d_sae), shapes, names, str(weights))

    architecture = str(cfg.get("architecture") or "").lower()
    act_fn = cfg.get("activation_fn") or cfg.get("activation_fn_str") or ""
    act_fn = str(act_fn).lower()
    kwargs = cfg.get("activation_fn_kwargs") if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
    k = cfg.get("k", kwargs.get("k"))
    hook_name = cfg.get("hook_name") or cfg.get("hook_point") or meta.get("hook_name")
    hook_name_out = cfg.get("hook_name_out") or cfg.get("hook_point_out") or meta.get("hook_name_out")
    transcoder = architecture in _TRANSCODER_ARCHITECTURES
    if architecture in ("skip_transcoder", "jumprelu_skip_transcoder"):
        raise SAEFormatError(
            f"Skip transcoders ({architecture}) are not supported",
            details={"path": str(directory), "architecture": architecture},
        )
    if transcoder:
        d_out = cfg.get("d_out")
        if d_out is not None and int(d_out) != d_in:
            raise SAEFormatError(
                f"Transcoder d_out={d_out} differs from d_in={d_in}; only MLP transcoders (d_out = d_in) can be attached",
                details={"path": str(directory), "d_out": d_out},
            )
        if not hook_name_out:
            raise SAEFormatError(
                f"Transcoder at {directory} names no output hook point (hook_name_out)",
                details={"path": str(directory)},
            )
        architecture = _TRANSCODER_ARCHITECTURES[architecture]
    elif hook_name_out:
        raise SAEFormatError(
            f"SAE at {directory} names an output hook point but is not a transcoder ({architecture or '-'})",
            details={"path": str(directory), "hook_name_out": hook_name_out},
        )
    if architecture == "gated":
        activation = "gated"
    elif (
        architecture == "jumprelu"
        or act_fn == "jumprelu"
        or ("threshold" in names and architecture in ("", "jumprelu"))
    ):
        activation = "jumprelu"
    elif architecture in ("topk", "batchtopk") or act_fn == "topk" or (k is not None and architecture in ("",)):
        activation = "topk"
    elif architecture in ("", "standard") and act_fn in ("", "relu"):
        activation = "relu"
    else:
        raise SAEFormatError(
            f"Unsupported SAE architecture/activation {architecture or '-'}/{act_fn or '-'}",
            details={"path": str(directory)},
        )
    norm = cfg.get("normalize_activations", meta.get("normalize_activations"))
    # pre-6.0 SAELens wrote a bool: True meant the April-2024 expected-average scaling
    if norm is True:
        norm = "expected_average_only_in"
    elif norm in (None, "None", False):
        norm = "none"
    factor = cfg.get("norm_scaling_factor", meta.get("norm_scaling_factor"))
    hook_point = parse_hook_point(hook_name, hook_name_out, source=str(directory))
    layer = _first(cfg, ("hook_layer", "hook_point_layer", "layer"))
    if layer is None:
        layer = meta.get("hook_layer")
    if layer is None:
        layer = _layer_from_text(hook_name)
    model_name = cfg.get("model_name") or meta.get("model_name")
    return SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        activation=activation,
        layout="saelens",
        path=str(directory),
        k=int(k) if activation == "topk" and k is not None else None,
        model_name=str(model_name) if model_name else None,
        layer=int(layer) if layer is not None else None,
        hook_name=str(hook_name) if hook_name else None,
        hook_point=hook_point,
        normalize_activations=str(norm),
        norm_scaling_factor=float(factor)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool)
        else factor,
        rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", not transcoder)),
        dtype=str(cfg.get("dtype") or "float32"),
        weights_file=str(weights),
        config_file=str(cfg_file),
    )


def _saelens_load(cfg: SAEConfig) -> dict[str, torch.Tensor]:
    try:
        # checked from its header first (offsets = shapes x dtypes = the file's size): a
        # safetensors file never materialises more than it holds
        raw = read_safetensors(cfg.weights_file, max_bytes=os.path.getsize(cfg.weights_file), framework="torch")
    except (ArchiveRefused, OSError) as exc:
        raise SAEFormatError(
            f"Cannot load SAE weights {cfg.weights_file}: {exc}",
            details={"path": cfg.weights_file, **getattr(exc, "details", {})},
        ) from exc
    return canonical_tensors(raw, cfg)


# ----------------------------------------------------------------------------- Gemma Scope

_GEMMA_SCOPE_MODEL = re.compile(r"gemma-scope-(\d+b)-(pt|it)")


def _gemmascope_detect(p: Path) -> Path | None:
    if p.is_file():
        return p if p.name.endswith(".npz") else None
    candidate = p / "params.npz"
    return candidate if candidate.is_file() else None


def _npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Read array shapes from the .npy headers inside the zip, without reading the data."""
    try:  # headers only, each checked against the zip directory (gpu_engine.api.archives)
        members = npz_members(path, max_bytes=NPZ_HEADER_SCAN_MAX_BYTES)
    except ArchiveRefused as exc:
        raise SAEFormatError(
            f"Corrupt Gemma Scope file {path}: {exc.message}", details={"path": str(path), **exc.details}
        ) from exc
    return {m.name: m.shape for m in members}


def _gemmascope_metadata(npz: Path) -> SAEConfig:
    shapes = _npz_shapes(npz)
    names = _resolve_shapes(shapes, str(npz))
    d_in, d_sae = _dims_from_shapes(shapes, names, str(npz))
    _check_shapes((d_in, d_sae), shapes, names, str(npz))
    if "threshold" not in names:
        raise SAEFormatError(f"Gemma Scope file {npz} has no threshold", details={"path": str(npz)})
    # Gemma Scope ships no config; a sidecar config (ours, or a mirror's) may name the model.
    sidecar: dict[str, Any] = {}
    config_file = None
    for name in CONFIG_NAMES:
        if (npz.parent / name).is_file():
            config_file = npz.parent / name
            sidecar = _read_json(config_file)
            break
    text = str(npz)
    layer = _first(sidecar, ("hook_layer", "layer"))
    if layer is None:
        layer = _layer_from_text(sidecar.get("hook_name")) if sidecar.get("hook_name") else _layer_from_text(text)
    model_name = sidecar.get("model_name")
    if not model_name:
        match = _GEMMA_SCOPE_MODEL.search(text)
        if match:
            model_name = f"gemma-2-{match.group(1)}" + ("-it" if match.group(2) == "it" else "")
    hook_name = sidecar.get("hook_name")
    hook_name_out = sidecar.get("hook_name_out")
    if not hook_name and layer is not None:
        # Gemma Scope repos say what they were trained on in their names (-res, -mlp,
        # -att: concatenated head outputs before o_proj, refused; -transcoders)
        kind = re.search(r"gemma-scope-[^/]*-(res|mlp|att|transcoders)\b", text)
        hook_name = {
            "mlp": f"blocks.{layer}.hook_mlp_out",
            "att": f"blocks.{layer}.attn.hook_z",
            "transcoders": f"blocks.{layer}.hook_mlp_in",
        }.get(kind.group(1) if kind else "", f"blocks.{layer}.hook_resid_post")
        if kind and kind.group(1) == "transcoders":
            hook_name_out = f"blocks.{layer}.hook_mlp_out"
    hook_point = parse_hook_point(hook_name, hook_name_out, source=str(npz))
    return SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        activation="jumprelu",
        layout="gemmascope",
        path=str(npz.parent),
        model_name=str(model_name) if model_name else None,
        layer=int(layer) if layer is not None else None,
        hook_name=str(hook_name) if hook_name else None,
        hook_point=hook_point,
        apply_b_dec_to_input=False,
        weights_file=str(npz),
        config_file=str(config_file) if config_file else None,
    )


def _gemmascope_load(cfg: SAEConfig) -> dict[str, torch.Tensor]:
    import torch

    # at most what the SAE's shapes need (two d_in x d_sae matrices and the vectors) in
    # float64: each member checked by its .npy header before it is inflated
    limit = (2 * cfg.d_in * cfg.d_sae + 4 * cfg.d_sae + 2 * cfg.d_in) * 8
    try:
        raw = {k: torch.from_numpy(v) for k, v in read_npz(cfg.weights_file, max_bytes=limit).items()}
    except ArchiveRefused as exc:
        raise SAEFormatError(
            f"Cannot load Gemma Scope file {cfg.weights_file}: {exc.message}",
            details={"path": cfg.weights_file, **exc.details},
        ) from exc
    return canonical_tensors(raw, cfg)


register_layout(SAELayout("saelens", _saelens_detect, _saelens_metadata, _saelens_load))
register_layout(SAELayout("gemmascope", _gemmascope_detect, _gemmascope_metadata, _gemmascope_load))


__all__ = [
    "CONFIG_NAMES",
    "SAELayout",
    "config_at_layer",
    "detect_layout",
    "get_layout",
    "read_sae_metadata",
    "resolve_layout",
    "register_layout",
    "registered_layouts",
]
