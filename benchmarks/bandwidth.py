"""The memory-bandwidth limit of batch-1 decoding, measured on the machine that decodes
(issue 17 item 8, SPEC §7), for ``benchmarks/run.py`` and the scripts that report against
it.

A batch-1 decode step reads every weight once.  The limit is measured as the issue asks:
a plain copy of a buffer the size of the weights, with every thread, best of ``reps``,
counted as the bytes it moves — read plus written, STREAM's convention; the limit in
tokens per second is that rate over the weight bytes.  A plain read (a ``sum`` over the
same buffer) is measured beside it (``read_gb_s``) as a check: on the machines of this
project the two agree within a few per cent (2026-12-01, AMD EPYC: copy 38.8 GB/s, read
40.1 GB/s, i.e. 72–74 tok/s for SmolLM2 in float32 — the figure SPEC §7 quotes).

Measure in a process, or a thread, that no engine shares: a second OpenMP thread team
throttles both (``one_team.py``) and the copy then reads up to 3× low.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

_CACHE: dict[Any, dict] = {}  # by weight bytes; (bytes, device) off the CPU


def copy_bandwidth(nbytes: int, reps: int = 7, *, again: bool = False, device: str = "cpu") -> dict:
    """A weights-sized copy, measured: ``gb_s`` (bytes read + written per second),
    ``read_gb_s`` (a sum's read rate over the same buffer), best and median times.
    Measured once per size; ``again`` measures anew (a long run measures before and after
    its work, since outside load moves the figure) and keeps whichever copied faster —
    the limit is what the machine can do, so a disturbed measurement must not lower it
    — with every measurement in ``measurements``.  On a ``device`` other than the CPU
    the copy is the device's own (a GPU's memory), each timing synchronised."""
    key = nbytes if device == "cpu" else (nbytes, device)
    if key in _CACHE and not again:
        return _CACHE[key]
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of both buffers
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    reads = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        src.sum()
        sync()
        reads.append(time.perf_counter() - t0)
    real = src.numel() * 4
    best = min(times)
    res = {
        "buffer_bytes": real,
        "reps": reps,
        "best_s": best,
        "median_s": statistics.median(times),
        "gb_s": 2 * real / best / 1e9,
        "read_gb_s": real / min(reads) / 1e9,
        "threads": torch.get_num_threads(),
        "convention": "copy: bytes read + bytes written",
    }
    if device != "cpu":
        res["device"] = device
    del src, dst
    earlier = _CACHE.get(key)
    res["measurements"] = [*(earlier["measurements"] if earlier else []), res["gb_s"]]
    if earlier is not None and earlier["gb_s"] >= res["gb_s"]:
        res = {**earlier, "measurements": res["measurements"]}
    _CACHE[key] = res
    return res


def limit_tok_s(nbytes: int) -> float:
    """The batch-1 decode limit of weights of ``nbytes``: the copy rate over them."""
    return copy_bandwidth(nbytes)["gb_s"] * 1e9 / nbytes


def weight_bytes(model_dir: Path, dtype_bytes: int | None = None) -> int:
    """Bytes of a safetensors checkpoint's tensors (from the file headers; ``dtype_bytes``
    re-counts every element at that width, e.g. 2 for a bf16 load of an fp32 file)."""
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            total += n * (dtype_bytes or sizes[t["dtype"]])
    return total


def measured() -> dict[Any, dict]:
    """Every measurement taken in this process, by weight bytes."""
    return dict(_CACHE)


__all__ = ["copy_bandwidth", "limit_tok_s", "measured", "weight_bytes"]
