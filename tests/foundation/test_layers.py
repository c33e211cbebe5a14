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


def test_the_web_reaches_the_engine_only_through_gpu_engine_api(tmp_path):
    """Positive control for the contract: a Django module importing an engine module other
    than gpu_engine.api (here the protocol's old path) breaks the suite."""
    config = (REPO / "pyproject.toml").read_text()
    probe = REPO / "ui" / "_engine_probe.py"
    probe.write_text("import gpu_engine.protocol  # noqa: F401\n")
    try:
        (tmp_path / "pyproject.toml").write_text(config)
        done = _lint("--config", str(tmp_path / "pyproject.toml"))
    finally:
        probe.unlink()
    assert done.returncode != 0
    assert "ui is not allowed to import gpu_engine" in done.stdout


def test_gpu_engine_api_imports_no_torch():
    """Every module of gpu_engine.api, imported in a fresh interpreter, leaves torch,
    transformers, vLLM and llama.cpp out of sys.modules (the contract sees only direct
    and indirect imports by name; this sees what really runs)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import gpu_engine.api as api\n"
        "for m in pkgutil.iter_modules(api.__path__):\n"
        "    importlib.import_module(f'gpu_engine.api.{m.name}')\n"
        "print(sorted(k for k in ('torch', 'transformers', 'vllm', 'llama_cpp') if k in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    probe = subprocess.run([sys.executable, "-c", code.replace("import gpu_engine.api as api\n",
                                                               "import gpu_engine.api as api, torch\n")],
                           cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert probe.stdout.strip() == "['torch']"  # positive control: the check sees torch
