"""The runtime names no backend adapter (pyproject.toml's last contract): a runtime
module importing one breaks the suite."""

from __future__ import annotations

from tests.foundation.test_layers import _lint_with_probe


def test_the_runtime_importing_an_adapter_breaks_the_contract(tmp_path):
    done = _lint_with_probe(tmp_path, "gpu_engine/runtime/_adapter_probe.py", "import gpu_engine.backends.llamacpp")
    assert done.returncode != 0
    assert "gpu_engine.runtime is not allowed to import gpu_engine.backends.llamacpp" in done.stdout


def test_the_runtime_may_load_through_the_registry(tmp_path):
    """The registry package itself is not an adapter: importing it keeps every contract."""
    done = _lint_with_probe(tmp_path, "gpu_engine/runtime/_registry_probe.py", "import gpu_engine.backends")
    assert done.returncode == 0, done.stdout + done.stderr
