"""Keep a benchmark process to one OpenMP thread team: the engine's.

With GNU OpenMP (PyTorch's CPU wheels) every thread that runs a parallel torch op gets a
thread team of its own, kept until the thread exits.  Once the teams' threads outnumber
the cores, libgomp stops spinning between parallel regions, and every kernel of every
team pays a futex wake-up: on the 2-core machines of this project the engine's decode
drops from ~18 to ~11 tok/s (SmolLM2-135M fp32, measured 2026-12-01) as soon as the
main thread has run one parallel op — a `sum` over a large tensor is enough.

A server has one team: the engine's worker thread is the only thread that computes
(the web tier never runs torch kernels, and demo assets are built by their own
command).  A benchmark that builds an SAE, loads a baseline model or runs HF `generate`
on its main thread measures a throttled engine instead.  So:

- ``passing(fn)``: set-up work (assets, SAEs, bandwidth) in a thread that ends — its
  team ends with it;
- ``on_engine(engine, fn)``: a baseline that must share the engine's process (HF
  `generate` on the engine's own model) on the engine's worker thread, between its
  tasks;
- ``in_processes(script, modes, …)``: engines compared with each other each in a process
  of their own, taking turns.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def passing(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that ends when it returns (re-raising what it raised)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name="bench-setup")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def on_engine(engine: Any, fn: Callable[[], T], timeout_s: float = 1800) -> T:
    """``fn()`` on ``engine``'s worker thread, as one of its control tasks."""
    return engine._call(fn, timeout_s=timeout_s)  # noqa: SLF001 - a benchmark's seam


def in_processes(
    script: Path, modes: list[str], argv: list[str], *, passes: int, timeout_s: float = 3600
) -> dict[str, list[dict]]:
    """``script *argv --one MODE`` for every mode, each in a process of its own (whose last
    printed line is its JSON), the modes taking turns ``passes`` times in a rotated order;
    each mode's results in the order they ran."""
    out: dict[str, list[dict]] = {m: [] for m in modes}
    for p in range(passes):
        k = p % len(modes)
        for mode in modes[k:] + modes[:k]:
            proc = subprocess.run(
                [sys.executable, str(script), *argv, "--one", mode],
                cwd=script.parent.parent,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if proc.returncode:
                sys.exit(f"{script.name} --one {mode} failed:\n{proc.stderr[-3000:]}")
            out[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


__all__ = ["in_processes", "on_engine", "passing"]
