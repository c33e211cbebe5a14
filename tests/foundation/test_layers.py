"""The layers of docs/architecture.md, kept by import-linter's contracts (pyproject.toml):
a wrong-way import anywhere in the tree fails the suite, not only a CI lint step."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a test requirement (requirements/dev.txt)"
    return subprocess.run([exe, "--no-cache", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_every_import_contract_is_kept():
    done = _lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_wrong_way_import_breaks_the_layers(tmp_path):
    """Positive control: the same contracts refuse registry importing orchestration."""
    config = (REPO / "pyproject.toml").read_text()
    probe = REPO / "registry" / "_layer_probe.py"
    probe.write_text("import orchestration.services  # noqa: F401\n")
    try:
        (tmp_path / "pyproject.toml").write_text(config)
        done = _lint("--config", str(tmp_path / "pyproject.toml"))
    finally:
        probe.unlink()
    assert done.returncode != 0
    assert "registry is not allowed to import orchestration" in done.stdout


def test_engine_md_declares_every_command_and_error_code():
    """docs/engine.md's command table and error table name every command of
    gpu_engine.commands and every EngineError code (three were missing)."""
    import re

    from gpu_engine import commands, errors
    from millm_site.config import BASE_DIR

    text = (BASE_DIR / "docs" / "engine.md").read_text()
    tables = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`([a-z_]+)`", tables))
    codes = {cls.code for cls in vars(errors).values() if isinstance(cls, type)
             and issubclass(cls, errors.EngineError) and cls is not errors.EngineError}
    assert codes - named == set()
    assert set(commands.COMMANDS) - named == set()
