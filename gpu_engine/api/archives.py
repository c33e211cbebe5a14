"""Bounded readers for the weight archives the server takes from users and downloads:
``.npz`` (probes, Gemma Scope SAEs) and safetensors (SAE weights, steering vectors,
captures). Torch-free and Django-free, so the web tier and the engine share it.

Why not ``np.load`` / ``safetensors.load_file`` directly: an ``.npz`` is a zip, and
``np.load`` inflates each member whole, trusting nothing but the compressed size, so a
24 KB upload whose member declares 24 GiB of zeros takes 24 GiB. Here every member's
``.npy`` header (shape, dtype, order) is read first without inflating the data; the bytes
it declares must match the member's uncompressed size in the zip directory and fit the
caller's limits; object dtypes are refused (nothing is ever unpickled); only then is the
member read, into a buffer of exactly the declared size, from a stream that zipfile
bounds by that same directory size. A safetensors file is checked the same way from its
header (bounded length, every tensor's shape times its dtype's size equal to its data
offsets, the offsets tiling the data exactly, the data the file's size and within the
limit) before any tensor is materialised.

A refusal is ``ArchiveRefused`` naming the member (or tensor) and why; each caller turns
it into its own documented error (``PROBE_INVALID``, ``SAE_INVALID``, ...).
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

# .npy data kinds that hold plain numbers or fixed-width text: never objects (``O``) or
# structured/void records (``V``, which may nest objects)
_NPY_KINDS = frozenset("biufcUS")
_NPY_HEADER_MAX = 10_000  # numpy's own default bound for one .npy header
MAX_MEMBERS = 256
_CHUNK = 1 << 20

# safetensors dtype tags -> bytes per element (the format's table)
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
# the safetensors library refuses longer headers too
SAFETENSORS_HEADER_MAX = 100_000_000

Source = str | os.PathLike[str] | bytes | bytearray | memoryview


class ArchiveRefused(ValueError):
    """An archive refused before anything was inflated; ``member`` names the ``.npz``
    member or safetensors tensor at fault (empty when the archive as a whole is)."""

    def __init__(self, message: str, *, member: str = "", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.member = member
        self.details: dict[str, Any] = {"member": member, **details} if member else dict(details)


@dataclass(frozen=True)
class NpyMember:
    """One ``.npz`` member as its header declares it."""

    name: str  # without ``.npy`` (the key ``np.load`` would give)
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    nbytes: int


def _opened(source: Source) -> Any:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    return os.fspath(source)


def _member_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[NpyMember, int]:
    name = info.filename[: -len(".npy")]
    with zf.open(info) as fh:
        try:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(  # type: ignore[call-arg]
                    fh, max_header_size=_NPY_HEADER_MAX
                )  # numpy >= 1.24 takes it; its stubs lag
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(  # type: ignore[call-arg]
                    fh, max_header_size=_NPY_HEADER_MAX
                )
            else:
                raise ValueError(f".npy format version {version} is not read here")
        except (ValueError, EOFError, OSError, SyntaxError) as exc:
            raise ArchiveRefused(
                f"member {info.filename!r} has no readable .npy header: {exc}", member=info.filename
            ) from exc
        offset = fh.tell()
    if dtype.hasobject or dtype.kind not in _NPY_KINDS:
        raise ArchiveRefused(
            f"member {info.filename!r} has dtype {dtype.str}, which is not "
            "plain numbers or text (objects are never unpickled)",
            member=info.filename,
            dtype=dtype.str,
        )
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ArchiveRefused(f"member {info.filename!r} declares shape {shape}", member=info.filename)
    nbytes = math.prod(shape) * dtype.itemsize
    return NpyMember(name, tuple(int(d) for d in shape), dtype, bool(fortran), nbytes), offset


def npz_members(
    source: Source, *, max_bytes: int, max_member_bytes: int | None = None, max_members: int = MAX_MEMBERS
) -> list[NpyMember]:
    """Every member of an ``.npz`` as its header declares it, checked against the limits
    and the zip directory; nothing beyond the headers is inflated."""
    return [
        m
        for m, _ in _checked_members(
            source, max_bytes=max_bytes, max_member_bytes=max_member_bytes, max_members=max_members, keep_open=None
        )
    ]


def _checked_members(
    source: Source, *, max_bytes: int, max_member_bytes: int | None, max_members: int, keep_open: list[Any] | None
) -> list[tuple[NpyMember, zipfile.ZipInfo]]:
    try:
        zf = zipfile.ZipFile(_opened(source))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ArchiveRefused(f"not a readable .npz (zip) archive: {exc}") from exc
    per_member = max_bytes if max_member_bytes is None else min(max_bytes, max_member_bytes)
    out: list[tuple[NpyMember, zipfile.ZipInfo]] = []
    try:
        infos = zf.infolist()
        if len(infos) > max_members:
            raise ArchiveRefused(
                f"the archive has {len(infos)} members; at most {max_members}", members=len(infos), limit=max_members
            )
        seen: set[str] = set()
        total = 0
        for info in infos:
            if info.is_dir() or not info.filename.endswith(".npy"):
                raise ArchiveRefused(f"member {info.filename!r} is not a .npy array", member=info.filename)
            if info.filename in seen:
                raise ArchiveRefused(f"member {info.filename!r} appears twice", member=info.filename)
            seen.add(info.filename)
            # the directory's own claim first: a member that says it inflates past the
            # limit is refused before one byte of it is inflated
            if info.file_size > per_member + _NPY_HEADER_MAX + 16:
                raise ArchiveRefused(
                    f"member {info.filename!r} inflates to {info.file_size} bytes; at most {per_member} are read",
                    member=info.filename,
                    declared_bytes=info.file_size,
                    limit=per_member,
                )
            member, offset = _member_header(zf, info)
            if member.nbytes > per_member or total + member.nbytes > max_bytes:
                raise ArchiveRefused(
                    f"member {info.filename!r} declares shape {list(member.shape)} of "
                    f"{member.dtype.str} ({member.nbytes} bytes); at most {per_member} per "
                    f"member and {max_bytes} in all are read",
                    member=info.filename,
                    declared_bytes=member.nbytes,
                    limit=per_member,
                )
            if offset + member.nbytes != info.file_size:
                raise ArchiveRefused(
                    f"member {info.filename!r} declares {member.nbytes} bytes of data but the "
                    f"zip directory says {info.file_size - offset}",
                    member=info.filename,
                    declared_bytes=member.nbytes,
                )
            total += member.nbytes
            out.append((member, info))
    except BaseException:
        zf.close()
        raise
    if keep_open is None:
        zf.close()
    else:
        keep_open.append(zf)
    return out


def read_npz(
    source: Source, *, max_bytes: int, max_member_bytes: int | None = None, max_members: int = MAX_MEMBERS
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` (name -> array, as ``np.load`` names them), each member
    checked by its header first and then read into a buffer of exactly its declared size;
    never more than ``max_bytes`` in all. ``ArchiveRefused`` names the member at fault."""
    holder: list[Any] = []
    checked = _checked_members(
        source, max_bytes=max_bytes, max_member_bytes=max_member_bytes, max_members=max_members, keep_open=holder
    )
    zf: zipfile.ZipFile = holder[0]
    out: dict[str, np.ndarray] = {}
    try:
        for member, info in checked:
            out[member.name] = _read_member(zf, info, member)
    finally:
        zf.close()
    return out


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, member: NpyMember) -> np.ndarray:
    buf = bytearray(member.nbytes)
    view = memoryview(buf)
    try:
        with zf.open(info) as fh:
            # the header was checked already: skip exactly its length (a few KB)
            fh.seek(info.file_size - member.nbytes)
            got = 0
            while got < member.nbytes:
                n = fh.readinto(view[got : got + _CHUNK])  # type: ignore[attr-defined]  # a ZipExtFile reads into
                if not n:
                    break
                got += n
            if got != member.nbytes:
                raise ArchiveRefused(
                    f"member {info.filename!r} ends after {got} of its {member.nbytes} bytes", member=info.filename
                )
            if fh.read(1):  # zipfile stops at the directory's size; reaching it checks the CRC
                raise ArchiveRefused(f"member {info.filename!r} holds more than it declares", member=info.filename)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        if isinstance(exc, ArchiveRefused):
            raise
        raise ArchiveRefused(f"member {info.filename!r} is corrupt: {exc}", member=info.filename) from exc
    arr = np.frombuffer(buf, dtype=member.dtype)
    return arr.reshape(member.shape, order="F" if member.fortran_order else "C")


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: tensors (name -> {dtype, shape, data_offsets}),
    ``metadata`` (``__metadata__``) and the data's size."""

    tensors: Mapping[str, Mapping[str, Any]]
    metadata: Mapping[str, str]
    data_bytes: int
    header_bytes: int


def _read_prefix(fh: BinaryIO, size: int | None, max_bytes: int) -> tuple[dict[str, Any], int]:
    raw = fh.read(8)
    if len(raw) != 8:
        raise ArchiveRefused("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    limit = min(SAFETENSORS_HEADER_MAX, max(1024, max_bytes))
    if n < 2 or n > limit:
        raise ArchiveRefused(f"the safetensors header declares {n} bytes; at most {limit}", header_bytes=n)
    if size is not None and 8 + n > size:
        raise ArchiveRefused(f"the safetensors header declares {n} bytes; the file has {size}")
    text = fh.read(n)
    if len(text) != n:
        raise ArchiveRefused("the safetensors header is cut short")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArchiveRefused(f"the safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ArchiveRefused("the safetensors header is not an object")
    return header, n


def check_safetensors(source: Source, *, max_bytes: int) -> SafetensorsHeader:
    """Check a safetensors file (a path or its bytes) from its header alone: the header's
    length bounded, every tensor's shape x dtype size equal to its data offsets, the
    offsets tiling the data with no gap or overlap, the data exactly the rest of the file
    and at most ``max_bytes``. ``ArchiveRefused`` names the tensor at fault."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        size = len(data)
        header, n = _read_prefix(io.BytesIO(data), size, max_bytes)
    else:
        try:
            size = Path(source).stat().st_size
            with open(source, "rb") as fh:
                header, n = _read_prefix(fh, size, max_bytes)
        except OSError as exc:
            raise ArchiveRefused(f"cannot read {Path(source).name}: {exc}") from exc
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ArchiveRefused("the safetensors __metadata__ is not a map of strings")
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise ArchiveRefused(f"tensor {name!r} has no description", member=name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise ArchiveRefused(f"tensor {name!r} has unknown dtype {dtype!r}", member=name)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ArchiveRefused(f"tensor {name!r} has shape {shape!r}", member=name)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise ArchiveRefused(f"tensor {name!r} has data_offsets {offsets!r}", member=name)
        declared = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        if declared > max_bytes:
            raise ArchiveRefused(
                f"tensor {name!r} declares shape {shape} of {dtype} ({declared} bytes); at most {max_bytes} are read",
                member=name,
                declared_bytes=declared,
                limit=max_bytes,
            )
        if offsets[1] - offsets[0] != declared:
            raise ArchiveRefused(
                f"tensor {name!r} declares {declared} bytes but its offsets span {offsets[1] - offsets[0]}", member=name
            )
        spans.append((offsets[0], offsets[1], name))
    held = size - 8 - n  # the data bytes the file holds after its header
    end = 0
    for begin, stop, name in sorted(spans):
        if stop > held:
            raise ArchiveRefused(
                f"tensor {name!r} ends at byte {stop} of the data; the file holds {held}",
                member=name,
                declared_bytes=stop - begin,
            )
        if begin != end:
            raise ArchiveRefused(
                f"tensor {name!r} starts at {begin}, not where the previous one ends ({end})", member=name
            )
        end = stop
    if end > max_bytes:
        raise ArchiveRefused(
            f"the tensors hold {end} bytes; at most {max_bytes} are read", declared_bytes=end, limit=max_bytes
        )
    if 8 + n + end != size:
        raise ArchiveRefused(f"the tensors declare {end} bytes of data; the file holds {size - 8 - n}")
    return SafetensorsHeader(header, meta, end, n)


def read_safetensors(source: Source, *, max_bytes: int, framework: str = "numpy") -> dict[str, Any]:
    """Every tensor of a checked safetensors file or buffer (numpy arrays, or torch
    tensors with ``framework="torch"``)."""
    check_safetensors(source, max_bytes=max_bytes)
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            if framework == "torch":
                from safetensors.torch import load
            else:
                from safetensors.numpy import load  # type: ignore[assignment]
            return dict(load(bytes(source)))
        if framework == "torch":
            from safetensors.torch import load_file

            return dict(load_file(os.fspath(source), device="cpu"))
        from safetensors.numpy import load_file as np_load_file

        return dict(np_load_file(os.fspath(source)))
    except ArchiveRefused:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ArchiveRefused(f"not a readable safetensors file: {exc}") from exc


__all__ = [
    "ArchiveRefused",
    "NpyMember",
    "SafetensorsHeader",
    "check_safetensors",
    "npz_members",
    "read_npz",
    "read_safetensors",
]
