"""Where each configuration variable takes effect: the source files that read it.

``manage.py check_config`` prints them beside each value. A file "reads" a variable when
its name appears there as a word; the declarations (``millm_site/config.py``), the
settings module that only re-exports names (``millm_site/settings/engine.py``), tests and
docs do not count. A variable of the original's reference that nothing reads yet is
declared ``unbuilt`` and refused at start-up unless left as it is.
"""

from __future__ import annotations

import re
from functools import lru_cache

from millm_site.config import BASE_DIR, VARIABLES

NOT_READERS = ("millm_site/config.py", "millm_site/config_readers.py",
               "millm_site/settings/engine.py", "millm_site/test_settings.py")
# what is not the product: tests, docs, measurements, requirement pins, data and caches
NOT_SOURCE = {"tests", "docs", "benchmarks", "requirements", "data"}


def _sources() -> dict[str, str]:
    texts: dict[str, str] = {}
    tops = [p for p in BASE_DIR.iterdir()
            if p.name not in NOT_SOURCE and (not p.name.startswith(".") or p.name == ".ci")]
    for root in tops:
        for path in (root.rglob("*") if root.is_dir() else [root]):
            if not path.is_file():
                continue
            rel = path.relative_to(BASE_DIR).as_posix()
            # code and templates, and the shell scripts that start things
            if (path.suffix not in (".py", ".html", ".js", ".sh")
                    and not rel.startswith(("scripts/", ".ci/"))):
                continue
            if rel in NOT_READERS or "/migrations/" in rel or "__pycache__" in rel:
                continue
            texts[rel] = path.read_text(errors="ignore")
    return texts


@lru_cache(maxsize=1)
def readers() -> dict[str, list[str]]:
    """``{variable: [files that read it, sorted]}`` for every declared variable."""
    words = {f: set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", text)) for f, text in _sources().items()}
    return {var.name: sorted(f for f, found in words.items() if var.name in found)
            for var in VARIABLES}


def unread() -> list[str]:
    """Variables that are accepted (not declared unbuilt) and read by nothing."""
    found = readers()
    return [var.name for var in VARIABLES if not var.unbuilt and not found[var.name]]


__all__ = ["readers", "unread"]
