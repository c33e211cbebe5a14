"""Raw steering vectors sent inline with a request, in packed binary form.

A packed vector is ``{dtype, shape, data}``: ``data`` the base64 of the vector's bytes,
little-endian, in ``dtype`` (float32, float16 or bfloat16), ``shape`` ``[d]`` (one
vector) or ``[n, d]`` (n rows, for the shapes that stack one row per layer). The same
shape the RhizoNymph vLLM steering fork sends (docs/api-v1.md, "Steering shapes from
other tools"); a JSON list of numbers is taken for small vectors too.

Decoded here (numpy, no torch) so that the web refuses a malformed vector naming its
field before anything runs, and the engine checks the same bytes again when a job
arrives from the queue (``SteeringVector.__post_init__``). Every refusal is an
``InvalidParameter`` naming ``param``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from .errors import InvalidParameter

VECTOR_DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# the widest residual stream a vector may carry, and the most rows one packed value stacks
MAX_VECTOR_WIDTH = 65_536
MAX_PACKED_ROWS = 256
# a JSON list of numbers is taken up to this many (a packed value beyond)
MAX_JSON_VECTOR = 16_384


def _bad(message: str, param: str) -> InvalidParameter:
    return InvalidParameter(message, param=param)


def as_float32(dtype: str, raw: bytes, param: str) -> np.ndarray:
    """``raw`` (little-endian ``dtype``) as float32, refusing a byte count that is not a
    whole number of values and any NaN or infinity."""
    if dtype not in ITEMSIZE:
        raise _bad(f"{param}: dtype must be one of {', '.join(VECTOR_DTYPES)} (got {dtype!r})", param)
    size = ITEMSIZE[dtype]
    if len(raw) % size:
        raise _bad(f"{param}: {len(raw)} bytes is not a whole number of {dtype} values", param)
    if dtype == "bfloat16":
        # bfloat16 is the top half of a float32: numpy has no such type
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, dtype="<f4" if dtype == "float32" else "<f2").astype(np.float32)
    if not np.isfinite(values).all():
        raise _bad(f"{param}: the vector holds NaN or infinite values", param)
    return values


def unpack(value: Any, param: str, *, max_rows: int = 1) -> tuple[str, np.ndarray, bytes]:
    """A packed ``{dtype, shape, data}`` (or a JSON list of numbers) as ``(dtype, rows
    (n, d) float32, the bytes as sent)``. ``max_rows`` 1: a single vector (``shape``
    ``[d]`` or ``[1, d]``)."""
    if isinstance(value, list):
        if not value or len(value) > MAX_JSON_VECTOR:
            raise _bad(f"{param}: a JSON vector holds 1 to {MAX_JSON_VECTOR} numbers; send larger ones packed", param)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise _bad(f"{param}: a JSON vector holds numbers only", param)
        rows = np.asarray(value, dtype=np.float32)[None, :]
        if not np.isfinite(rows).all():
            raise _bad(f"{param}: the vector holds NaN or infinite values", param)
        return "float32", rows, rows.astype("<f4").tobytes()
    if not isinstance(value, dict):
        raise _bad(f"{param}: a vector is {{dtype, shape, data}} (base64) or a list of numbers", param)
    unknown = sorted(set(value) - {"dtype", "shape", "data"})
    if unknown:
        raise _bad(f"{param}: unknown key {unknown[0]!r} (a packed vector is {{dtype, shape, data}})", param)
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _bad(f"{param}.dtype must be one of {', '.join(VECTOR_DTYPES)} (got {dtype!r})", f"{param}.dtype")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)
    ):
        raise _bad(f"{param}.shape must be [d] or [rows, d] of positive integers", f"{param}.shape")
    n_rows, width = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
    if n_rows > max_rows:
        raise _bad(f"{param}.shape: at most {max_rows} row(s) here (got {n_rows})", f"{param}.shape")
    if width > MAX_VECTOR_WIDTH:
        raise _bad(f"{param}.shape: a vector is at most {MAX_VECTOR_WIDTH} wide (got {width})", f"{param}.shape")
    if not isinstance(data, str):
        raise _bad(f"{param}.data must be a base64 string", f"{param}.data")
    expected = n_rows * width * ITEMSIZE[dtype]
    # the base64 of ``expected`` bytes is this long: refuse a larger body before decoding it
    if len(data) > 4 * ((expected + 2) // 3) + 4:
        raise _bad(f"{param}.data: more than the {expected} bytes shape {shape} of {dtype} holds", f"{param}.data")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{param}.data is not valid base64", f"{param}.data") from None
    if len(raw) != expected:
        raise _bad(f"{param}.data: {len(raw)} bytes, but shape {shape} of {dtype} is {expected} bytes", f"{param}.data")
    return dtype, as_float32(dtype, raw, f"{param}.data").reshape(n_rows, width), raw


def pack(values: np.ndarray, dtype: str = "float32") -> dict[str, Any]:
    """``values`` ((d,) or (n, d)) as a packed vector: what a client sends."""
    arr = np.asarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        raw = (arr.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        raw = arr.astype("<f4" if dtype == "float32" else "<f2").tobytes()
    return {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(raw).decode("ascii")}


__all__ = ["ITEMSIZE", "MAX_VECTOR_WIDTH", "VECTOR_DTYPES", "as_float32", "pack", "unpack"]
