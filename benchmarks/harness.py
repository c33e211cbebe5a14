"""The harness of ``benchmarks/run.py``: a table row and its verdict against a target
(``Row``, ``target``), the machine a run was measured on and its kind (``machine``,
``cpu_facts``, ``machine_kind``) and the software (``software``), running one benchmark
script as a subprocess of its own and reading its JSON (``Ctx.script``, which raises
``Failed`` with its log), and the output (the table, the PNG plot). The groups that use
it are ``benchmarks/suites.py``; comparing results files is ``benchmarks/compare.py``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
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
    machine: str = ""  # the machine kind it was measured on (``machine_kind``), set by run.py

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


# the ISA flags of /proc/cpuinfo that decide which kernels the CPU runs (recorded as they are)
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# (family, first model, last model) -> microarchitecture, for the server CPUs this project meets
_UARCH = {
    "AMD": [
        (0x17, 0x00, 0x2F, "Zen"),
        (0x17, 0x30, 0xFF, "Zen 2"),
        (0x19, 0x00, 0x0F, "Zen 3"),
        (0x19, 0x10, 0x1F, "Zen 4"),
        (0x19, 0x20, 0x5F, "Zen 3"),
        (0x19, 0x60, 0xAF, "Zen 4"),
        (0x1A, 0x00, 0xFF, "Zen 5"),
    ],
    "Intel": [
        (6, 0x55, 0x55, "Skylake/Cascade Lake"),
        (6, 0x6A, 0x6C, "Ice Lake"),
        (6, 0x8F, 0x8F, "Sapphire Rapids"),
        (6, 0xCF, 0xCF, "Emerald Rapids"),
        (6, 0xAD, 0xAE, "Granite Rapids"),
    ],
}
_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}


def product_line(model_name: str) -> str:
    """The vendor and product line of a CPU's model name: ``Intel(R) Xeon(R) Platinum
    8488C`` -> ``Intel Xeon``, ``AMD EPYC 9R14 96-Core Processor`` -> ``AMD EPYC``."""
    words = re.sub(r"\((R|TM|tm|r)\)", " ", model_name).split()
    return " ".join(words[:2])


def machine_kind(vendor: str, model_name: str, family: int | None, model: int | None, flags: list[str]) -> str:
    """What makes two machines comparable: product line, microarchitecture where the
    family and model say it, and the vector ISA (``AMD EPYC Zen 4 (AVX-512)``,
    ``Intel Xeon Sapphire Rapids (AVX-512, AMX)``, ``Intel Xeon Emerald Rapids (AVX-512)``
    where a VM hides AMX). Two runs compare as before and after only on one kind."""
    line = product_line(model_name) or vendor or platform.machine()
    uarch = next(
        (u for f, lo, hi, u in _UARCH.get(vendor, []) if f == family and model is not None and lo <= model <= hi),
        "",
    )
    isa = ", ".join(name for flag, name in (("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags) or (
        "AVX2" if "avx2" in flags else ""
    )
    return " ".join(p for p in (line, uarch) if p) + (f" ({isa})" if isa else "")


def cpu_facts(cpuinfo: str) -> dict:
    """Vendor, model name, family and model, the ``KEY_FLAGS`` present and the kind, from
    the text of /proc/cpuinfo (its first processor)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    vendor = _VENDORS.get(fields.get("vendor_id", ""), fields.get("vendor_id", ""))
    model_name = fields.get("model name", "") or platform.processor()
    present = set(fields.get("flags", "").split())
    flags = [f for f in KEY_FLAGS if f in present]

    def number(key: str) -> int | None:
        return int(fields[key]) if fields.get(key, "").isdigit() else None

    family, model = number("cpu family"), number("model")
    return {
        "kind": machine_kind(vendor, model_name, family, model, flags),
        "vendor": vendor,
        "model_name": model_name,
        "family": family,
        "model": model,
        "flags": flags,
    }


def machine() -> dict:
    """The machine block of results.json, at the start of a run: ``cpu_facts`` of
    /proc/cpuinfo, the logical CPUs this process may use and the load average (run.py
    adds the load average at the end and the bandwidth)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    return cpu_facts(cpuinfo) | {"cpus": cpus, "load_average_start": os.getloadavg()}


def software() -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import torch

    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
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
