"""Which files of a hub repository a download fetches, and what an SAE's path says about
it. Only safetensors, JSON, tokenizer and template files are fetched for a model (pickle
formats never); ``.py`` files only with ``trust_remote_code``."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken")
SAE_FILE_SUFFIXES = (".safetensors", ".json", ".npz")

# GGUF repositories hold one file (or one split set) per quantization, named by it:
# "SmolLM2-135M-Instruct.Q4_1.gguf", "model-Q4_K_M-00001-of-00002.gguf", "model-f16.gguf"
_GGUF_SPLIT = re.compile(r"-\d{5}-of-\d{5}(?=\.gguf$)", re.IGNORECASE)
_QUANT = re.compile(r"^(?:I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32|FP16|FP32)$", re.IGNORECASE)


def split_repo_quant(repo_id: str) -> tuple[str, str | None]:
    """``org/repo:Q4_K_M`` → (``org/repo``, ``Q4_K_M``); a bare name has no quant."""
    repo, sep, quant = repo_id.partition(":")
    return repo, (quant.upper() if sep and quant else None)


def gguf_quant(filename: str) -> str | None:
    """The quantization a GGUF file's name states (upper case), or None."""
    stem = _GGUF_SPLIT.sub("", PurePosixPath(filename).name)
    if not stem.lower().endswith(".gguf"):
        return None
    for part in reversed(re.split(r"[-.]", stem[:-5])):
        if _QUANT.match(part):
            return part.upper()
    return None


def gguf_quants(files: list[tuple[str, int]]) -> dict[str, list[tuple[str, int]]]:
    """The GGUF files at the repository's root by quantization (every part of a split
    model; multimodal projectors left out), each list first part first."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name, size in sorted(files):
        if "/" in name or "mmproj" in name.lower():
            continue
        quant = gguf_quant(name)
        if quant is not None:
            out.setdefault(quant, []).append((name, size))
    return out


def gguf_quantization(quant: str) -> str:
    """The registry's coarse quantization (``Model.Quantization``) of a GGUF quant."""
    q = quant.upper()
    if q in ("F32", "FP32"):
        return "FP32"
    if q in ("F16", "FP16", "BF16"):
        return "FP16"
    bits = int(re.search(r"\d", q).group())  # type: ignore[union-attr]
    return "Q8" if bits >= 5 else "Q4" if bits >= 3 else "Q2"


def sibling_files(info: Any) -> list[tuple[str, int]]:
    return [(s.rfilename, int(s.size or 0)) for s in (info.siblings or [])]


def select_model_files(files: list[tuple[str, int]], *, trust_remote_code: bool) -> list[tuple[str, int]]:
    """The files a transformers checkpoint needs, at the repository's root."""
    chosen = []
    for name, size in files:
        if "/" in name:
            continue  # variants and originals (onnx/, original/*.pth) live in folders
        if name.endswith(MODEL_FILE_SUFFIXES) or (trust_remote_code and name.endswith(".py")):
            chosen.append((name, size))
    return chosen


def sae_dir_of(file_path: str) -> str:
    """The repository folder that holds one SAE: the file's folder, or the folder named."""
    path = PurePosixPath(file_path.strip("/"))
    if path.suffix in SAE_FILE_SUFFIXES:
        return str(path.parent) if str(path.parent) != "." else ""
    return str(path)


def select_sae_files(files: list[tuple[str, int]], file_path: str) -> list[tuple[str, int]]:
    folder = sae_dir_of(file_path) if file_path else ""
    chosen = []
    for name, size in files:
        parent = str(PurePosixPath(name).parent)
        parent = "" if parent == "." else parent
        if folder and parent != folder:
            continue
        if not folder and parent:
            continue
        if name.endswith(SAE_FILE_SUFFIXES):
            chosen.append((name, size))
    return chosen


_LAYER = re.compile(
    r"(?:layer[_-]?|blocks\.|\.layers?\.|(?:^|[/.-]|(?<!average)_)l)(\d+)"
    r"(?=[/_.-]|$)",
    re.IGNORECASE,
)
_WIDTH = re.compile(r"width[_-]?(\w+?)(?:/|$|_)", re.IGNORECASE)
_L0 = re.compile(r"average_l0[_-]?(\d+)", re.IGNORECASE)


def describe_sae_path(path: str) -> dict[str, Any]:
    layer = _LAYER.search(path)
    width = _WIDTH.search(path)
    l0 = _L0.search(path)
    return {
        "layer": int(layer.group(1)) if layer else None,
        "width": width.group(1) if width else None,
        "average_l0": int(l0.group(1)) if l0 else None,
    }
