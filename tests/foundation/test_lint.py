"""The tree passes ruff (lint and format, pyproject.toml [tool.ruff]) and the engine's api
and backend contract pass mypy ([tool.mypy]); each check is shown to fail on a file that
breaks it, so a check that stopped looking would be seen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_lint_passes():
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_passes():
    result = _run("ruff", "format", "--no-cache", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_passes_on_the_api_and_the_backend_contract():
    result = _run("mypy", "--no-incremental", "--python-executable", sys.executable)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu_engine" not in result.stdout  # no finding named


def test_the_checks_see_a_broken_file(tmp_path):
    """Positive controls, with the project's settings: an unused import, a badly formatted
    line and a wrong return type are each reported."""
    config = ["--config", str(REPO / "pyproject.toml")]
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    assert _run("ruff", "check", "--no-cache", *config, str(bad)).returncode == 1
    bad.write_text("x = [1,2]\n")
    assert _run("ruff", "format", "--no-cache", "--check", *config, str(bad)).returncode == 1
    bad.write_text("def f() -> int:\n    return 'a'\n")
    typed = _run("mypy", "--no-incremental", "--config-file", str(REPO / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert typed.returncode == 1 and "Incompatible return value type" in typed.stdout
