"""The harness of ``benchmarks/run.py``: a table row and its verdict against a target
(``Row``, ``target``), the machine a run was measured on (``machine``), running one
benchmark script as a subprocess of its own and reading its JSON (``Ctx.script``, which
raises ``Failed`` with its log), and the output (the table, the PNG plot). The groups
that use it are ``benchmarks/suites.py``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks"


@dataclass
class Row:
    group: str
    what: str
    ratio: float | None = None
    target: str = ""  # e.g. ">= 0.95 (SPEC §7)"
    op: str = ""  # ">=" or "<=" when the target is a number
    threshold: float | None = None
    status: str = ""  # met / missed / — / not built / not installed / failed / not measured
    note: str = ""

    def judge(self, quick: bool = False) -> Row:
        if self.status:
            return self
        if self.ratio is None:
            self.status = "not measured"
        elif self.threshold is None:
            self.status = "—"
        else:
            ok = self.ratio >= self.threshold if self.op == ">=" else self.ratio <= self.threshold
            self.status = "met" if ok else "missed"
            if quick:
                self.status += " (--quick: meaningless)"
        return self


def target(op: str, value: float, source: str) -> dict:
    return {"op": op, "threshold": value, "target": f"{'≥' if op == '>=' else '≤'} {value:g} ({source})"}


# ------------------------------------------------------------------ the machine


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import torch

    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_start": os.getloadavg(),
    }


# ------------------------------------------------------------------ running the scripts


class Failed(Exception):
    pass


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.out: Path = args.out
        self.model = args.model or ("tiny-llama" if args.quick else "smollm2-135m")
        self.tokens = args.tokens or (4 if args.quick else 64)
        self.rounds = args.rounds or (1 if args.quick else 3)
        self.asset_root = Path(os.environ.get("MILLM_TEST_ASSET_DIR") or REPO / ".cache" / "test-assets")
        self.raw: dict = {}

    def script(
        self, group: str, name: str, argv: list[str], *, json_flag: bool = True, timeout: int | None = None
    ) -> dict | list:
        """Run ``benchmarks/<name>`` with ``argv`` (+ ``--json FILE``); its JSON, or the
        last JSON line it printed when it has no ``--json``."""
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out_json = self.out / "raw" / f"{group}-{name.removesuffix('.py')}-{len(self.raw.get(group, []))}.json"
        out_json.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / name), *argv] + (["--json", str(out_json)] if json_flag else [])
        print(f"[{group}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with open(logs / f"{group}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            try:
                proc = subprocess.run(
                    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout or self.args.timeout
                )
            except subprocess.TimeoutExpired as e:
                raise Failed(f"{name} ran past {e.timeout:.0f} s; see {log.name}") from None
            log.write(proc.stdout)
        if proc.returncode:
            raise Failed(f"{name} exited {proc.returncode}; see {logs / (group + '.log')}")
        if json_flag:
            data = json.loads(out_json.read_text())
        else:
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                raise Failed(f"{name} printed no JSON line")
            data = json.loads(lines[-1])
        self.raw.setdefault(group, []).append(
            {"script": name, "argv": argv, "seconds": time.monotonic() - t0, "result": data}
        )
        return data


# ------------------------------------------------------------------ output


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def print_table(rows: list[Row], quick: bool) -> None:
    w = max(len(r.what) for r in rows)
    wt = max([len(r.target) for r in rows] + [6])
    print()
    if quick:
        print("--quick: tiny model, few tokens, one round: FIGURES ARE MEANINGLESS (a smoke run)")
    print(f"{'group':<15} {'what':<{w}} {'ratio':>7}  {'target':<{wt}}  status")
    for r in rows:
        print(
            f"{r.group:<15} {r.what:<{w}} {fmt_ratio(r.ratio):>7}  {r.target:<{wt}}  {r.status}"
            + (f"  ({r.note})" if r.note and r.status in ("failed", "not installed", "not built") else "")
        )


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 0.32 * len(rows) + 1.8))
    colors = {"met": "tab:green", "missed": "tab:red"}  # "met (--quick…)" too
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        if r.ratio is not None:
            ax.barh(y, r.ratio, color=colors.get(r.status.split(" ")[0], "tab:gray"))
            ax.text(r.ratio, y, f" {r.ratio:.3f}", va="center", fontsize=7)
            if r.threshold is not None:
                ax.plot([r.threshold, r.threshold], [y - 0.4, y + 0.4], color="black", linewidth=2)
        else:
            ax.text(0.02, y, r.status, va="center", fontsize=7, style="italic", transform=ax.get_yaxis_transform())
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"[{r.group}] {r.what}"[:110] for r in reversed(rows)], fontsize=7)
    top = max([r.ratio for r in rows if r.ratio is not None] + [r.threshold or 0 for r in rows] + [1.0])
    ax.set_xlim(0, top * 1.12)
    ax.axvline(1.0, color="gray", linewidth=0.5)
    ax.set_xlabel("ratio (black tick: target; green met, red missed, gray no target)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
