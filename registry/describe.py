"""What the files on disk say: the checks on a local path and the description of a
transformers checkpoint, a GGUF file or an SAE (architecture, sizes, layout). Registering
and downloading both read files through these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import SAEInvalid
from gpu_engine.api.errors import EngineError
from gpu_engine.api.host import inspect_model_dir
from gpu_engine.api.sae import read_sae_metadata
from registry import sizing
from registry.access import check_under_roots
from registry.errors import InvalidLocalPath, ModelInvalid
from registry.hub_files import gguf_quant, gguf_quantization
from registry.models import Model

# Registering one of these (or anything under them) as a model directory would let the
# model loader and prune_cache walk system files; the original refused them too.
SYSTEM_DIRECTORIES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/run",
    "/sbin",
    "/sys",
    "/usr/bin",
    "/usr/lib",
    "/usr/sbin",
    "/usr/include",
    "/var/lib",
    "/var/log",
    "/var/run",
)


def check_local_path(raw: str, *, what: str = "a model") -> Path:
    """An absolute path under LOCAL_MODEL_ROOTS that exists and lies outside the system
    directories, resolved (symlinks followed, so two spellings of one directory are one
    path). A path outside the roots gets one answer whether it exists or not."""
    if not raw or not raw.strip():
        raise InvalidLocalPath(f"local_path is required to register {what}", details={"local_path": raw})
    path = Path(raw.strip())
    if not path.is_absolute():
        raise InvalidLocalPath("local_path must be an absolute path", details={"local_path": raw})
    resolved = check_under_roots(raw, path)
    if str(resolved) == "/" or any(str(resolved) == d or str(resolved).startswith(d + "/") for d in SYSTEM_DIRECTORIES):
        raise InvalidLocalPath(f"{resolved} is a system directory and cannot hold {what}", details={"local_path": raw})
    try:
        exists = resolved.exists()
    except OSError as exc:  # a name too long, a folder we may not enter
        raise InvalidLocalPath(
            f"{raw.strip()[:200]} cannot be read: {exc.strerror}", details={"local_path": raw}
        ) from exc
    if not exists:
        raise InvalidLocalPath(f"{resolved} does not exist", details={"local_path": raw})
    return resolved


def dir_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe_transformers_dir(path: Path, quantization: str | None = None) -> dict[str, Any]:
    import json

    try:
        info = inspect_model_dir(path)
    except EngineError as exc:
        raise ModelInvalid(
            f"{path} is not a readable transformers checkpoint: {exc.message}", details={"local_path": str(path)}
        ) from exc
    estimated = info.estimated_memory_bytes
    if quantization and quantization != Model.Quantization.FP32:
        config = json.loads((path / "config.json").read_text())
        estimated = sizing.estimate_bytes(parameter_count=info.param_count, config=config, quantization=quantization)
    return {
        "architecture": info.architecture_class,
        "num_layers": info.num_layers,
        "hidden_size": info.hidden_size,
        "context_length": info.context_length,
        "parameter_count": info.param_count,
        "disk_size_bytes": info.disk_size_bytes,
        "estimated_memory_bytes": estimated,
    }


def chat_template_text(path: Path) -> str | None:
    """The chat template(s) a transformers checkpoint directory ships, as one text
    (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``: a string or
    a list of named templates), or a GGUF file's ``tokenizer.chat_template``; None when
    there is none or it cannot be read here."""
    texts: list[str] = []
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        try:
            item = GGUFReader(str(path), "r").fields.get("tokenizer.chat_template")
        except Exception:  # noqa: BLE001 - gguf raises assorted errors on bad files
            return None
        return str(item.contents()) if item is not None else None
    try:
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            texts.append(jinja.read_text(errors="ignore"))
        config = path / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text()).get("chat_template")
            if isinstance(value, str):
                texts.append(value)
            elif isinstance(value, list):
                texts.extend(str(t.get("template", "")) for t in value if isinstance(t, dict))
    except (OSError, ValueError):
        return None
    return "\n".join(texts) if texts else None


def describe_gguf_file(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # noqa: BLE001 - gguf raises assorted errors on bad files
        raise ModelInvalid(
            f"{path.name} is not a readable GGUF file: {exc}", details={"local_path": str(path)}
        ) from exc

    def field(name: str) -> Any:
        item = reader.fields.get(name)
        return item.contents() if item is not None else None

    arch = field("general.architecture") or ""
    params = sum(int(t.n_elements) for t in reader.tensors)
    size = path.stat().st_size
    quantization = _gguf_file_quantization(field("general.file_type"), path.name)
    return {
        **({"quantization": quantization} if quantization else {}),
        "architecture": str(arch),
        "num_layers": field(f"{arch}.block_count"),
        "hidden_size": field(f"{arch}.embedding_length"),
        "context_length": field(f"{arch}.context_length"),
        "parameter_count": params,
        "disk_size_bytes": size,
        "estimated_memory_bytes": size,
    }


def _gguf_file_quantization(file_type: Any, filename: str) -> str | None:
    """The registry's quantization of a GGUF file: its ``general.file_type`` (``MOSTLY_Q4_1``
    → Q4), else what its name states; None when neither says."""
    from gguf import LlamaFileType

    quant = None
    if file_type is not None:
        try:
            quant = LlamaFileType(int(file_type)).name.split("_", 1)[1]
        except (ValueError, IndexError):
            quant = None
    quant = quant or gguf_quant(filename)
    return gguf_quantization(quant) if quant else None


def describe_sae(path: Path) -> dict[str, Any]:
    try:
        meta = read_sae_metadata(path)
    except EngineError as exc:
        raise SAEInvalid(f"{path} is not a readable SAE: {exc.message}", details={"local_path": str(path)}) from exc
    except OSError as exc:  # files the server may not read
        raise SAEInvalid(f"{path} is not a readable SAE: {exc}", details={"local_path": str(path)}) from exc
    return {
        "format": meta.layout,
        "d_in": meta.d_in,
        "d_sae": meta.d_sae,
        "width": meta.d_sae,
        "activation": meta.activation,
        "topk_k": meta.k,
        "trained_on_model": meta.model_name or "",
        "trained_on_layer": meta.layer,
        "hook_name": meta.hook_name or "",
        "neuronpedia_id": neuronpedia_id(meta.config_file),
    }


def neuronpedia_id(config_file: str | None) -> str:
    """A SAELens cfg.json's ``neuronpedia_id`` ("model/source", at the top or, from
    SAELens 6, under ``metadata``), or "" (none, not a string, not model/source)."""
    if not config_file:
        return ""
    try:
        path = Path(config_file)
        if path.stat().st_size > 2**20:
            return ""
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(cfg, dict):
        return ""
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    value = cfg.get("neuronpedia_id") or meta.get("neuronpedia_id")
    if not isinstance(value, str):
        return ""
    value = value.strip()
    model, sep, source = value.partition("/")
    if not (sep and model and source) or len(value) > 300:
        return ""
    return value
