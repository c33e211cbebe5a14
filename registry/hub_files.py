"""Which files of a hub repository a download fetches, and what an SAE's path says about
it. Only safetensors, JSON, tokenizer and template files are fetched for a model (pickle
formats never); ``.py`` files only with ``trust_remote_code``."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken")
SAE_FILE_SUFFIXES = (".safetensors", ".json", ".npz")
def sibling_files(info: Any) -> list[tuple[str, int]]:
    return [(s.rfilename, int(s.size or 0)) for s in (info.siblings or [])]


def select_model_files(files: list[tuple[str, int]], *, trust_remote_code: bool
                       ) -> list[tuple[str, int]]:
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


_LAYER = re.compile(r"(?:layer[_-]?|blocks\.|\.layers?\.|(?:^|[/.-]|(?<!average)_)l)(\d+)"
                    r"(?=[/_.-]|$)", re.IGNORECASE)
_WIDTH = re.compile(r"width[_-]?(\w+?)(?:/|$|_)", re.IGNORECASE)
_L0 = re.compile(r"average_l0[_-]?(\d+)", re.IGNORECASE)


def describe_sae_path(path: str) -> dict[str, Any]:
    layer = _LAYER.search(path)
    width = _WIDTH.search(path)
    l0 = _L0.search(path)
    return {"layer": int(layer.group(1)) if layer else None,
            "width": width.group(1) if width else None,
            "average_l0": int(l0.group(1)) if l0 else None}
