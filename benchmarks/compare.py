"""Comparing ``benchmarks/run.py`` results files (``run.py --against OLD.json``): one
table of every ratio row, its target and its value on each machine kind side by side.

Each row of a results file carries the machine kind it was measured on (``Row.machine``;
a file written before rows carried it gets the kind of its ``meta["cpu"]``, "flags not
recorded"). The table has one column per kind; a kind measured in several of the files
has one column per file instead ("before" and "after" for two), then the last minus the
first. Rows are matched by group and description, with the figures measured in the run
that some descriptions carry (the bandwidth limit's tok/s, a draft's acceptance) left out
of the match; a row that one column lacks shows "—" there. A file that cannot be read as
a results file raises ``BadResults`` with a one-line message (run.py exits 2 with it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import machine_kind

ABSENT = "—"
# measured figures inside a row's description: "(72.3 tok/s)", ", acceptance 0.02"
_MEASURED = re.compile(r"\s*\([^()]*\d\.\d[^()]*\)|,\s*acceptance [\d.]+")


class BadResults(Exception):
    """A file given to compare that is not a results.json of ``benchmarks/run.py``."""


@dataclass
class Results:
    label: str  # the path as given
    meta: dict
    machine: dict
    rows: list[dict]

    def kind(self, row: dict) -> str:
        return row.get("machine") or self.machine.get("kind") or ""


def load(path: Path | str, label: str | None = None) -> Results:
    """A results file (or a folder holding ``results.json``), checked for the shape
    run.py writes: ``meta`` and ``rows`` of group, description, ratio and status."""
    path = Path(path)
    label = label or str(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadResults(f"{path}: no such file") from None
    except OSError as e:
        raise BadResults(f"{path}: cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise BadResults(f"{path}: not JSON (not even text)") from None
    except json.JSONDecodeError as e:
        raise BadResults(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) or not isinstance(data.get("rows"), list):
        raise BadResults(f'{path}: not a benchmarks/run.py results file (it needs "meta" and "rows")')
    for i, r in enumerate(data["rows"]):
        if not (
            isinstance(r, dict)
            and isinstance(r.get("group"), str)
            and isinstance(r.get("what"), str)
            and isinstance(r.get("status", ""), str)
            and (r.get("ratio") is None or isinstance(r.get("ratio"), (int, float)))
        ):
            raise BadResults(
                f"{path}: rows[{i}] is not a benchmarks/run.py row (group, what, ratio a number or null, status)"
            )
    mach = data.get("machine")
    if not isinstance(mach, dict):  # written before results.json had a machine block
        cpu = str(data["meta"].get("cpu", ""))
        mach = {
            "kind": (machine_kind("", cpu, None, None, []) or "unknown machine") + " (flags not recorded)",
            "model_name": cpu,
            "cpus": data["meta"].get("cpus"),
            "load_average_start": data["meta"].get("load_average_start"),
            "load_average_end": data["meta"].get("load_average_end"),
        }
    return Results(label, data["meta"], mach, data["rows"])


def row_key(row: dict) -> tuple[str, str]:
    return row["group"], _MEASURED.sub("", row["what"])


def cell(row: dict | None) -> str:
    if row is None:
        return ABSENT
    status = (row.get("status") or "").split(" (")[0]  # "met (--quick: meaningless)" -> "met"
    if row.get("ratio") is None:
        return status or "not measured"
    return f"{row['ratio']:.3f}" + (f" {status}" if status in ("met", "missed") else "")


def _describe(i: int, res: Results) -> str:
    m, meta = res.machine, res.meta
    bw = (m.get("bandwidth") or {}).get("gb_s")
    load = (m.get("load_average_start"), m.get("load_average_end"))
    parts = [
        f"commit {meta['commit']}" if meta.get("commit") else "",
        str(meta.get("date", "")),
        m.get("model_name", ""),
        f"{m['cpus']} CPUs" if m.get("cpus") else "",
        f"copy {bw:.1f} GB/s" if isinstance(bw, (int, float)) else "",
        f"load {load[0][0]:.1f} → {load[1][0]:.1f}" if all(isinstance(x, list) and x for x in load) else "",
        "--quick: figures meaningless" if meta.get("quick") else "",
    ]
    return f"[{i}] {res.label}: " + ", ".join(p for p in parts if p)


def table(files: list[Results]) -> str:
    """The comparison as text: rows in the order they first appear, a column (or a
    before / after / difference set of columns) per machine kind, then a line per file."""
    # each file's rows by kind and key
    by: dict[tuple[str, int], dict[tuple[str, str], dict]] = {}
    kinds: list[str] = []
    keys: dict[tuple[str, str], str] = {}  # key -> target
    for i, res in enumerate(files):
        for r in res.rows:
            k = res.kind(r)
            if k not in kinds:
                kinds.append(k)
            by.setdefault((k, i), {}).setdefault(row_key(r), r)
            if not keys.get(row_key(r)):
                keys[row_key(r)] = r.get("target") or ""
    # per kind, its columns: (header, the cell of a row's key)
    groups: list[tuple[str, list[tuple[str, Callable[[tuple[str, str]], str]]]]] = []
    for k in kinds:
        held = [i for i in range(len(files)) if (k, i) in by]
        cols: list[tuple[str, Callable[[tuple[str, str]], str]]] = []
        if len(held) == 1:
            cols.append((f"[{held[0] + 1}]", lambda key, s=by[(k, held[0])]: cell(s.get(key))))
        else:
            names = ["before", "after"] if len(held) == 2 else [""] * len(held)
            for name, i in zip(names, held):
                cols.append(((f"{name} " if name else "") + f"[{i + 1}]", lambda key, s=by[(k, i)]: cell(s.get(key))))

            def diff(key: tuple[str, str], first=by[(k, held[0])], last=by[(k, held[-1])]) -> str:
                a, b = first.get(key), last.get(key)
                if a is None or b is None or a.get("ratio") is None or b.get("ratio") is None:
                    return ""
                return f"{b['ratio'] - a['ratio']:+.3f}"

            cols.append(("after − before" if len(held) == 2 else "last − first", diff))
        groups.append((k, cols))

    lines_body = [[*key, target] + [f(key) for _, cols in groups for _, f in cols] for key, target in keys.items()]
    heads = ["group", "what", "target"] + [h for _, cols in groups for h, _ in cols]
    widths = [max([len(h)] + [len(b[j]) for b in lines_body]) for j, h in enumerate(heads)]
    # a kind's name spans its columns (widened when the name is longer)
    j = 3
    for k, cols in groups:
        span = sum(widths[j : j + len(cols)]) + 2 * (len(cols) - 1)
        if len(k) > span:
            widths[j + len(cols) - 1] += len(k) - span
        j += len(cols)

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if n < 3 else c.rjust(w) for n, (c, w) in enumerate(zip(cells, widths))).rstrip()

    top = "  ".join(" " * w for w in widths[:3])
    j = 3
    for k, cols in groups:
        span = sum(widths[j : j + len(cols)]) + 2 * (len(cols) - 1)
        top += "  " + k.rjust(span)
        j += len(cols)
    out = [
        "Ratios compared: a column per machine kind; a kind in several files: before, after, the difference",
        top.rstrip(),
        line(heads),
        *(line(b) for b in lines_body),
        "",
        *(_describe(i + 1, res) for i, res in enumerate(files)),
    ]
    return "\n".join(out)


__all__ = ["ABSENT", "BadResults", "Results", "load", "row_key", "table"]
