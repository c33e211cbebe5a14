"""The host's memory, read without Django or torch: what a load or an attach may use on a
CPU engine (``MemAvailable``), and handing freed heap back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# when /proc/meminfo cannot be read (not Linux): assume this much is available
FALLBACK_AVAILABLE = 8 << 30
# bytes per KV element of llama.cpp's cache for each GGUF_KV_CACHE_TYPE (block size /
# elements per block): the engine sizes its window by it, the web tier's memory fit too
GGUF_KV_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}


def host_memory() -> dict[str, int] | None:
    """``{"free": MemAvailable, "total": MemTotal}`` in bytes, or None off Linux."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in found:
        return None
    return {"free": found["MemAvailable"], "total": found.get("MemTotal", found["MemAvailable"])}


def available_memory() -> int:
    mem = host_memory()
    return mem["free"] if mem is not None else FALLBACK_AVAILABLE


@functools.cache
def _malloc_trim() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return getattr(libc, "malloc_trim", None)
    except OSError:
        return None


def trim_host_heap() -> bool:
    """glibc's ``malloc_trim(0)``: return the free pages of malloc's arenas to the system
    (large tensors are mmapped and go back when freed; the arenas keep the rest). False
    where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)  # type: ignore[operator]
    return True


__all__ = ["GGUF_KV_BYTES", "available_memory", "host_memory", "trim_host_heap"]
