"""Where each configuration variable takes effect: the source files that read it.

``manage.py check_config`` prints them beside each value. A Python file "reads" a variable
when its name is a name in the code (``settings.X``, ``CONFIG.X``) or a whole string literal
(``getattr(settings, "X")``, ``os.environ["X"]``); a comment, a docstring or a message that
mentions it does not count. Templates, scripts and JavaScript count the name as a word. The
declarations (``millm_site/config_variables.py``, parsed by ``millm_site/config.py``), the
settings module that only re-exports names (``millm_site/settings/engine.py``), tests and
docs do not count. A variable of the original's reference that nothing reads yet is
declared ``unbuilt`` and refused at start-up unless left as it is.
"""

from __future__ import annotations

import re
from functools import lru_cache

from millm_site.config import BASE_DIR, VARIABLES

NOT_READERS = (
    "millm_site/config.py",
    "millm_site/config_variables.py",
    "millm_site/config_readers.py",
    "millm_site/settings/engine.py",
    "millm_site/test_settings.py",
)
# variables whose effect the declarations module builds itself (Config.database turns
# DATABASE_URL into Django's DATABASES), so no other file names them
BUILT_IN_CONFIG = {"DATABASE_URL": "millm_site/config.py"}
# what is not the product: tests, docs, measurements, requirement pins, data and caches
NOT_SOURCE = {"tests", "docs", "benchmarks", "requirements", "data"}


def _sources() -> dict[str, str]:
    texts: dict[str, str] = {}
    tops = [
        p for p in BASE_DIR.iterdir() if p.name not in NOT_SOURCE and (not p.name.startswith(".") or p.name == ".ci")
    ]
    for root in tops:
        for path in root.rglob("*") if root.is_dir() else [root]:
            if not path.is_file():
                continue
            rel = path.relative_to(BASE_DIR).as_posix()
            # code and templates, and the shell scripts that start things
            if path.suffix not in (".py", ".html", ".js", ".sh") and not rel.startswith(("scripts/", ".ci/")):
                continue
            if rel in NOT_READERS or "/migrations/" in rel or "__pycache__" in rel:
                continue
            texts[rel] = path.read_text(errors="ignore")
    return texts


_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def _code_words(text: str) -> set[str]:
    """The upper-case names a Python source uses as code: names and attributes (also
    inside f-strings), and string literals that are exactly one name; not comments,
    docstrings or prose in messages."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", text))
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            value = node.id
        elif isinstance(node, ast.Attribute):
            value = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
        else:
            continue
        if _NAME.fullmatch(value):
            words.add(value)
    return words


@lru_cache(maxsize=1)
def readers() -> dict[str, list[str]]:
    """``{variable: [files that read it, sorted]}`` for every declared variable."""
    words = {
        f: _code_words(text) if f.endswith(".py") else set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", text))
        for f, text in _sources().items()
    }
    out = {var.name: sorted(f for f, found in words.items() if var.name in found) for var in VARIABLES}
    for name, where in BUILT_IN_CONFIG.items():
        out[name] = sorted({*out[name], where})
    return out


def unread() -> list[str]:
    """Variables that are accepted (not declared unbuilt) and read by nothing."""
    found = readers()
    return [var.name for var in VARIABLES if not var.unbuilt and not found[var.name]]


__all__ = ["readers", "unread"]
