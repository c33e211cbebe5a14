"""The lean decode step's small operations as three C functions (``cpu_fused.c``), for
float32 on the CPU (MILLM_ENGINE_FUSED_KERNELS).

Why: a batch-1 decode step of SmolLM2-135M spends ~24 ms in its 121 products and, on
top, ~11 ms in the ~1,200 small PyTorch calls between them — norms, rotary, cache
writes, attention, SiLU, adds — each a few microseconds of dispatch for a few hundred
floats of work (docs/performance.md, "Serial decode step").  Here each run of them
between two products is one call: ``add_rms`` (residual add and RMS norm),
``attention`` (rotary, the new key and value into the cache, attention over the cached
positions) and ``silu_mul``.  The products stay PyTorch's (plain, oneDNN-packed or
quantized weights alike), and so do the hooks: lean.py calls these between them.

With several rows (a batch step), attention's (row, head) pairs and SiLU's rows are
shared out over the calling thread's OpenMP team — PyTorch's own, so no second team
competes for the cores (benchmarks/one_team.py says why that matters); one row runs on
the calling thread.

The source is compiled the first time it is needed, by the machine's C compiler
(``cc``, or ``$CC``) with ``-O3 -march=native -fopenmp``, into a per-user directory under the
system's temporary directory, keyed by a hash of the source, the flags, the compiler's
version and the CPU's model and flags (so a build for one CPU is never loaded on
another).  It takes well under a second.  Where there is no compiler or the build fails,
``kernels()`` returns None with the reason (``why_not``) and the step keeps its PyTorch
calls: the results differ from those only in the last bits of float32 (reductions in
another order), and tests/engine/test_fused_kernels.py holds the two together.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("gpu_engine.transformers")

SOURCE = Path(__file__).with_name("cpu_fused.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
# several rows' attention and SiLU run on the calling thread's OpenMP team: built with
# -fopenmp the library needs libgomp.so.1, which is the one PyTorch's CPU build already
# loaded (same soname, so the loader hands back that copy). Where it would be another
# runtime (a PyTorch built with Intel's), the library is built without (NO_THREADS).
THREADS, NO_THREADS = ("-fopenmp",), ("-fopenmp-simd",)

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "millm_add_rms": (_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr, _ptr),
    "millm_silu_mul": (_ptr, _i64, _i64, _ptr),
    "millm_attention": (_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _f32, _ptr, _ptr),
}

_why_not: str | None = None


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one line of each kind (every core repeats them)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (by file)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {line.split()[-1] for line in maps.splitlines() if any(n in line.rsplit("/", 1)[-1] for n in names)}


def _build(threads: tuple[str, ...] = THREADS) -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    flags = (*FLAGS, *threads)
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    directory = Path(tempfile.gettempdir()) / f"millm-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
    target = directory / f"cpu_fused-{key}.so"
    if target.exists():
        return target
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", partial, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)  # atomic: a concurrent build leaves one whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


class Kernels:
    """The built library's three functions, with their C signatures."""

    def __init__(self, path: Path, *, threaded: bool) -> None:
        self.path = path
        self.threaded = threaded  # several rows over the calling thread's OpenMP team
        # PyDLL: the calls keep the GIL (they take microseconds; releasing and taking it back
        # around each would let another thread of the process, a web loop, hold it between them)
        lib = ctypes.PyDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = None
        self.add_rms = lib.millm_add_rms
        self.silu_mul = lib.millm_silu_mul
        self.attention = lib.millm_attention
        self._lib = lib


@functools.cache
def kernels() -> Kernels | None:
    """The kernels, built on first use; None (and ``why_not`` says why) where they
    cannot be built on this machine."""
    global _why_not
    try:
        before = _openmp_runtimes()
        kernels = Kernels(_build(), threaded=True)
        if len(_openmp_runtimes()) > max(len(before), 1):  # a second runtime came with it
            log.warning("the C kernels' OpenMP runtime is not PyTorch's; building them single-threaded")
            kernels = Kernels(_build(NO_THREADS), threaded=False)
        return kernels
    except Exception as exc:  # no compiler, a failed build, an unloadable library
        _why_not = f"the C kernels could not be built: {exc}"
        log.warning("fused CPU kernels unavailable, the lean step keeps its PyTorch calls: %s", exc)
        return None


def why_not() -> str | None:
    """Why ``kernels()`` returned None (None when it has not failed)."""
    return _why_not


__all__ = ["FLAGS", "Kernels", "kernels", "why_not"]
