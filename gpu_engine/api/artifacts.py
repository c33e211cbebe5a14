"""Capture artifacts: one safetensors file per request plus its JSON sidecar, and the
reader that rebuilds a request's tensors from them.

Light on purpose (no torch, no Django at import): the web tier stores and serves these
files, and a client outside miLLM reads them with ``load_capture`` and nothing but
``safetensors`` and ``numpy`` (``framework="torch"`` for bfloat16 captures, which numpy
cannot hold).

The file holds ``layer.<L>`` (rows, hidden_size) in the model's dtype for every captured
layer, ``positions`` (rows,) — the residual row (sequence position) of each row — and
``token_ids`` (rows,) — the token fed at that position.  The sidecar (``SIDECAR_KEY`` in
the safetensors header, and ``<id>.json`` beside a stored file) says what was captured:
request id, model, backend, layers, positions mode, prompt and completion token ids,
dtype, steering hash.

An attention capture adds ``q.<L>`` (q rows, heads, head_dim) — the queries of the chosen
heads after the model's position encoding — and ``k.<L>`` (k rows, kv_heads, head_dim) —
the keys of the KV heads those heads read — with ``q_positions`` and ``k_positions``; the
sidecar's ``attention`` says which heads (``heads``, ``kv_heads``, ``num_heads``,
``num_kv_heads``, ``head_dim``) and the scale each layer's attention applies.

Tensor parallelism (the vLLM backend): each rank takes the Q/K of the heads it holds.
When more than one rank took some, the file holds one shard per rank —
``q.<L>.tp<rank>`` (q rows, the rank's heads, head_dim) and ``k.<L>.tp<rank>`` — and the
sidecar's ``attention.shards`` lists each shard's ``rank``, ``heads`` and ``kv_heads``
(global indices; a KV head replicated on several ranks appears in each).
``load_capture`` merges them on read into the one ``q[L]``/``k[L]`` of ``heads`` and
``kv_heads`` order, as if one rank had taken them all.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, BinaryIO

FORMAT = "millm-capture/1"
SIDECAR_KEY = "millm_capture"
CAPTURE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def is_capture_id(value: str) -> bool:
    """Capture ids are 32 lowercase hex digits: nothing else names a file."""
    return bool(CAPTURE_ID_RE.match(value or ""))


def file_names(capture_id: str) -> tuple[str, str]:
    if not is_capture_id(capture_id):
        raise ValueError(f"not a capture id: {capture_id!r}")
    return f"{capture_id}.safetensors", f"{capture_id}.json"


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a temporary file beside ``path``, flushed to disk, then renamed to
    ``path``: a reader sees the whole file under its name or nothing; on any failure the
    temporary file is removed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_pair(root: Path, capture_id: str, meta: dict[str, Any], write: Callable[[BinaryIO], object]) -> str:
    """The sidecar, then the tensors file (each atomically); the sidecar is removed again
    when the tensors file cannot be written, so a failed capture leaves nothing under its
    names."""
    root.mkdir(parents=True, exist_ok=True)
    tensors_name, sidecar_name = file_names(capture_id)
    sidecar = root / sidecar_name
    _write_atomic(sidecar, lambda fh: fh.write(json.dumps(meta, sort_keys=True).encode()))
    try:
        _write_atomic(root / tensors_name, write)
    except BaseException:
        sidecar.unlink(missing_ok=True)
        raise
    return tensors_name


def write_files(directory: str | Path, capture_id: str, data: bytes, meta: dict[str, Any]) -> str:
    """Write ``<id>.safetensors`` (``data``, a whole safetensors file) and ``<id>.json``
    under ``directory`` (each atomically); returns the safetensors file's name."""
    return _write_pair(Path(directory), capture_id, meta, lambda fh: fh.write(data))


@dataclass
class TensorBytes:
    """One tensor to stream into a safetensors file: its safetensors ``dtype`` (``F32``,
    ``BF16``, ``I64``, …), ``shape``, and its bytes in row-major little-endian order (any
    object with the buffer protocol: a numpy array's memory, not a copy)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any
    nbytes: int


def safetensors_layout(tensors: list[TensorBytes], metadata: dict[str, str]) -> tuple[bytes, list[TensorBytes]]:
    """The safetensors prefix (8-byte little-endian header length, then the JSON header
    padded with spaces to 8 bytes) and the tensors in the order their bytes follow it:
    ``__metadata__`` first, tensors by element size, largest first, then by name — for
    the dtypes a capture holds (int64 beside one float type) the layout ``safetensors``'
    own ``save`` writes, byte for byte."""
    from .archives import SAFETENSORS_DTYPE_BYTES

    ordered = sorted(tensors, key=lambda t: (-SAFETENSORS_DTYPE_BYTES[t.dtype], t.name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in ordered:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


def write_streamed(
    directory: str | Path, capture_id: str, tensors: list[TensorBytes], metadata: dict[str, str], meta: dict[str, Any]
) -> tuple[str, int]:
    """``write_files`` for a capture too large to hold twice in memory: the safetensors
    file is written tensor by tensor from the tensors' own memory (no serialised copy;
    the interpreter lock is released while the bytes go to the file).  Returns the file's
    name and size."""
    prefix, ordered = safetensors_layout(tensors, metadata)

    def write(fh: BinaryIO) -> None:
        fh.write(prefix)
        for t in ordered:
            if t.nbytes:
                fh.write(t.data)

    name = _write_pair(Path(directory), capture_id, meta, write)
    return name, len(prefix) + sum(t.nbytes for t in ordered)


@dataclass
class CaptureData:
    """One request's capture, rebuilt: ``hidden[layer]`` (rows, hidden_size), row
    ``positions`` and ``token_ids`` (arrays of the chosen framework), and the sidecar."""

    meta: dict[str, Any]
    hidden: dict[int, Any] = field(default_factory=dict)
    positions: Any = None
    token_ids: Any = None
    # attention capture: q[layer] (rows, heads, head_dim), k[layer] (rows, kv_heads, head_dim)
    q: dict[int, Any] = field(default_factory=dict)
    k: dict[int, Any] = field(default_factory=dict)
    q_positions: Any = None
    k_positions: Any = None

    @property
    def attention(self) -> dict[str, Any] | None:
        return self.meta.get("attention")

    @property
    def layers(self) -> list[int]:
        return sorted(self.hidden)


def load_capture(source: str | Path | bytes, *, framework: str = "numpy") -> CaptureData:
    """Rebuild a capture from a safetensors file path or its bytes (an inline artifact,
    base64-decoded). ``framework``: ``numpy`` or ``torch``."""
    if framework not in ("numpy", "torch"):
        raise ValueError("framework must be 'numpy' or 'torch'")
    from .archives import check_safetensors

    # the header's shapes and offsets checked against the bytes there are before any
    # tensor is built (ArchiveRefused, a ValueError, names the tensor at fault)
    size = len(source) if isinstance(source, (bytes, bytearray)) else Path(source).stat().st_size
    check_safetensors(source, max_bytes=size)
    if isinstance(source, (bytes, bytearray)):
        if framework == "torch":
            from safetensors.torch import load as load_bytes
        else:
            from safetensors.numpy import load as load_bytes  # type: ignore[assignment]
        tensors = load_bytes(bytes(source))
        meta = json.loads(_header_metadata(bytes(source)).get(SIDECAR_KEY, "{}"))
    else:
        from safetensors import safe_open

        with safe_open(str(source), framework="pt" if framework == "torch" else "np") as fh:
            meta = json.loads((fh.metadata() or {}).get(SIDECAR_KEY, "{}"))
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a miLLM capture (format {meta.get('format')!r}, expected {FORMAT!r})")
    out = CaptureData(
        meta=meta,
        positions=tensors.get("positions"),
        token_ids=tensors.get("token_ids"),
        q_positions=tensors.get("q_positions"),
        k_positions=tensors.get("k_positions"),
    )
    for name, value in tensors.items():
        kind, _, layer = name.partition(".")
        if kind == "layer":
            out.hidden[int(layer)] = value
        elif kind in ("q", "k") and layer.isdigit():
            getattr(out, kind)[int(layer)] = value
    shards = (meta.get("attention") or {}).get("shards")
    if shards:
        _merge_shards(out, tensors, meta["attention"], framework)
    return out


def _merge_shards(out: CaptureData, tensors: dict[str, Any], att: dict[str, Any], framework: str) -> None:
    """``q.<L>.tp<r>``/``k.<L>.tp<r>`` into ``out.q[L]``/``out.k[L]``: each head of
    ``att["heads"]`` (``kv_heads``) taken from the shard that lists it, in that order."""
    if framework == "torch":
        import torch

        def stack(parts: list[Any]) -> Any:
            return torch.stack(parts, dim=1)
    else:
        import numpy as np

        def stack(parts: list[Any]) -> Any:
            return np.stack(parts, axis=1)

    for kind, wanted, listed in (("q", att["heads"], "heads"), ("k", att["kv_heads"], "kv_heads")):
        for layer in att["layers"]:
            where: dict[int, Any] = {}
            for shard in att["shards"]:
                name = f"{kind}.{layer}.tp{int(shard['rank'])}"
                if name not in tensors:
                    raise ValueError(f"capture shard {name} is missing")
                for j, head in enumerate(shard[listed]):
                    where.setdefault(int(head), tensors[name][:, j])
            missing = [h for h in wanted if h not in where]
            if missing:
                raise ValueError(f"capture shards of {kind}.{layer} lack {listed} {missing}")
            getattr(out, kind)[int(layer)] = stack([where[int(h)] for h in wanted])


def _header_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors buffer (8-byte little-endian header length,
    then the JSON header)."""
    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})


__all__ = [
    "FORMAT",
    "SIDECAR_KEY",
    "CaptureData",
    "TensorBytes",
    "file_names",
    "is_capture_id",
    "load_capture",
    "safetensors_layout",
    "write_files",
    "write_streamed",
]
