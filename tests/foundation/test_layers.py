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
    return subprocess.run(
        [exe, "--no-cache", *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_every_import_contract_is_kept():
    done = _lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _lint_with_probe(tmp_path, module: str, line: str):
    """The contracts run over the tree plus one probe module holding ``line``."""
    config = (REPO / "pyproject.toml").read_text()
    probe = REPO / module
    probe.write_text(f"{line}  # noqa: F401\n")
    try:
        (tmp_path / "pyproject.toml").write_text(config)
        return _lint("--config", str(tmp_path / "pyproject.toml"))
    finally:
        probe.unlink()


def test_a_wrong_way_import_breaks_the_layers(tmp_path):
    """Positive control: the same contracts refuse registry importing orchestration."""
    done = _lint_with_probe(tmp_path, "registry/_layer_probe.py", "import orchestration.services")
    assert done.returncode != 0
    assert "registry is not allowed to import orchestration" in done.stdout


def test_engine_md_declares_every_command_and_error_code():
    """docs/engine.md's command table and error table name every command of
    gpu_engine.api.commands and every EngineError code (three were missing)."""
    import re

    from gpu_engine.api import commands, errors
    from millm_site.config import BASE_DIR

    text = (BASE_DIR / "docs" / "engine.md").read_text()
    tables = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`([a-z_]+)`", tables))
    codes = {
        cls.code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.EngineError) and cls is not errors.EngineError
    }
    assert codes - named == set()
    assert set(commands.COMMANDS) - named == set()


def test_the_web_reaches_the_engine_only_through_gpu_engine_api(tmp_path):
    """Positive control for the contract: a Django module importing an engine module other
    than gpu_engine.api (here the runtime's stream) breaks the suite."""
    done = _lint_with_probe(tmp_path, "ui/_engine_probe.py", "import gpu_engine.runtime.stream")
    assert done.returncode != 0
    assert "ui is not allowed to import gpu_engine" in done.stdout


def test_a_wrong_way_import_breaks_the_engine_layers(tmp_path):
    """Positive control for the engine's layers contract: the api importing the runtime (a
    higher layer) breaks the suite; so does an engine module importing one of the api's
    doors to higher layers (the layers contract's exceptions rely on that)."""
    done = _lint_with_probe(tmp_path, "gpu_engine/api/_layer_probe.py", "import gpu_engine.runtime.stream")
    assert done.returncode != 0
    assert "gpu_engine.api is not allowed to import gpu_engine.runtime" in done.stdout
    done = _lint_with_probe(tmp_path, "gpu_engine/decode/_door_probe.py", "import gpu_engine.api.analysis")
    assert done.returncode != 0
    assert "gpu_engine.decode is not allowed to import gpu_engine.api.analysis" in done.stdout


def test_the_engine_never_imports_the_offline_asset_builders(tmp_path):
    """Positive control for the asset contracts: an engine module importing the test and
    demo asset builders breaks the suite, and so does a web app other than the demo
    installer (registry.services)."""
    done = _lint_with_probe(tmp_path, "gpu_engine/sae/_assets_probe.py", "import offline_assets.saes")
    assert done.returncode != 0
    assert "gpu_engine is not allowed to import offline_assets" in done.stdout
    done = _lint_with_probe(tmp_path, "ui/_assets_probe.py", "import offline_assets.demo")
    assert done.returncode != 0
    assert "ui is not allowed to import offline_assets" in done.stdout


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
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    probe = subprocess.run(
        [sys.executable, "-c", code.replace("import gpu_engine.api as api\n", "import gpu_engine.api as api, torch\n")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.stdout.strip() == "['torch']"  # positive control: the check sees torch


PROJECT_PACKAGES = (
    "millm_site",
    "system",
    "ui",
    "features",
    "batches",
    "inference",
    "orchestration",
    "monitoring",
    "steering",
    "leases",
    "registry",
    "core",
    "gpu_engine",
    "offline_assets",
)


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere in the file (module level or inside a
    function: a lazy import hides a circle, it does not remove it), ``if TYPE_CHECKING``
    blocks left out. ``from a import b`` names ``a.b`` when that is a module, else ``a``."""
    import ast

    files = {}
    for package in PROJECT_PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path

    def imports(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (n for branch in child.orelse for n in imports_in(branch))
                continue
            yield from imports_in(child)

    def imports_in(node: ast.AST):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            yield from imports(node)

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            found |= {name for name in names if name in files and name != module}
        graph[module] = found
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_file_level_import_circles():
    """No two project files import each other, directly or round a loop (a service that
    enqueues its own task does it by name through core.jobs; shared helpers live below
    both users)."""
    found = _circles(_import_graph(REPO))
    assert found == []


def test_the_circle_check_sees_a_lazy_circle():
    """Positive control: a function-level import back from core.errors into core.api (which
    imports core.errors) is a circle the check reports."""
    graph = _import_graph(REPO)
    assert "core.errors" in graph["core.api"]
    graph["core.errors"] = graph["core.errors"] | {"core.api"}
    assert any({"core.api", "core.errors"} <= set(group) for group in _circles(graph))


def test_a_task_is_enqueued_by_its_name():
    """What lets a service enqueue its own task without importing the task module (which
    imports the service): core.jobs resolves the registered name to the same task."""
    import pytest

    from core.jobs import resolve_task
    from orchestration.tasks import model_load_task

    assert resolve_task("orchestration.tasks.model_load_task") is model_load_task
    assert resolve_task(model_load_task) is model_load_task
    with pytest.raises(ValueError, match="no task named"):
        resolve_task("orchestration.tasks.no_such_task")
    with pytest.raises(ValueError, match="no task named"):
        resolve_task("orchestration.services.model_load")  # a function, not that task
