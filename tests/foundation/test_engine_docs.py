"""docs/engine.md's module table against the folders: every package under gpu_engine and
every module at its top is named by a row, and every name a row gives exists.

A row's first cell names modules in backticks, relative to gpu_engine, with ``.`` or ``/``
between parts (``api.protocol``, ``backends/base``); after the first, a bare name is taken
beside the first (``backends/transformers/batched``, ``kv_cache`` is
``backends/transformers/kv_cache``) and a name with an extension is a file
(``cpu_fused.c``)."""

from __future__ import annotations

import re
from pathlib import Path

from millm_site.config import BASE_DIR

ENGINE = Path(BASE_DIR) / "gpu_engine"
# what a name ending so is: a file beside the modules, not a dotted module path
FILE_SUFFIXES = (".c", ".h", ".md", ".json")


def module_table(text: str) -> list[str]:
    """The first cells of the first table after "## Modules"."""
    lines = text.split("## Modules", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows[2:]  # the header and its rule


def _path(name: str) -> Path | None:
    """What ``name`` (relative to gpu_engine) is on disk: a file, a module or a package."""
    if Path(name).suffix in FILE_SUFFIXES:
        parts = name.split("/")  # a file named with its extension (cpu_fused.c)
    else:
        parts = name.split("/") if "/" in name else name.split(".")
    base = ENGINE.joinpath(*parts)
    for candidate in (base.with_name(base.name + ".py"), base):
        if candidate.is_file() or (candidate / "__init__.py").is_file():
            return candidate
    return None


def row_names(cell: str) -> list[tuple[str, Path | None]]:
    """Each name of a first cell and where it lies (None: nowhere)."""
    names = re.findall(r"`([^`]+)`", cell)
    out: list[tuple[str, Path | None]] = []
    first: Path | None = None
    for i, name in enumerate(names):
        found = _path(name)
        bare = "/" not in name and ("." not in name or Path(name).suffix in FILE_SUFFIXES)
        if i and first is not None and bare:
            beside = first.parent if first.name != "__init__.py" else first.parent.parent
            local = beside / name
            for candidate in (local.with_name(name + ".py"), local):
                if candidate.is_file() or (candidate / "__init__.py").is_file():
                    found = candidate
                    break
        if i == 0:
            first = found
        out.append((name, found))
    return out


def test_the_module_table_names_every_package_and_only_what_exists():
    rows = module_table((Path(BASE_DIR) / "docs" / "engine.md").read_text())
    assert rows, "docs/engine.md has no module table under ## Modules"
    named: set[Path] = set()
    missing = []
    for cell in rows:
        for name, found in row_names(cell):
            if found is None:
                missing.append(f"{name!r} (row {cell!r})")
            else:
                named.add(found.parent if found.is_file() and found.name == "__init__.py" else found)
    assert missing == [], "rows name what does not exist under gpu_engine: " + ", ".join(missing)

    packages = sorted(
        p.parent for p in ENGINE.rglob("__init__.py") if p.parent != ENGINE and "__pycache__" not in p.parts
    )
    top_modules = sorted(p for p in ENGINE.glob("*.py") if p.name != "__init__.py")

    def covered(path: Path) -> bool:
        # a package is named by its own row or by a row naming a module inside it
        return path in named or any(path in n.parents for n in named)

    unnamed = [str(p.relative_to(ENGINE)) for p in [*packages, *top_modules] if not covered(p)]
    assert unnamed == [], "no row of docs/engine.md's module table names: " + ", ".join(unnamed)


def test_the_table_reader_resolves_names_beside_the_first():
    """The reader's own rules on a made-up row (its positive control)."""
    names = dict(row_names("`backends/transformers/batched`, `kv_cache`, `no_such_module`"))
    assert names["kv_cache"] == ENGINE / "backends" / "transformers" / "kv_cache.py"
    assert names["no_such_module"] is None
    assert dict(row_names("`api.protocol` (`api.fields`, `codec`)"))["codec"] == ENGINE / "api" / "codec.py"
