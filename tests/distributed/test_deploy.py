"""The deployment files parse and agree with the code: Docker and Kubernetes are not
runnable here, so this checks their structure — the services and containers exist, the
engine asks for a GPU, every miLLM variable they set is one the configuration knows, and
the commands are the ones this project ships."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import yaml

from millm_site.config import VARIABLES_BY_NAME

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# set in the files for the images themselves, not read by miLLM's configuration
FOREIGN = {
    "POSTGRES_USER",
    "POSTGRES_PASSWORD",
    "POSTGRES_DB",
    "PGDATA",
    "DJANGO_SETTINGS_MODULE",
    "CUDA_VISIBLE_DEVICES",
}


def _known(name: str) -> bool:
    return name in VARIABLES_BY_NAME or name in FOREIGN


def _k8s() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_compose_has_the_topology():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"web", "worker", "loader", "engine", "postgres", "redis", "migrate"} <= set(services)
    gpu = services["engine"]["deploy"]["resources"]["reservations"]["devices"][0]
    # one card (of its own: the second engine has another, device_ids)
    assert gpu["capabilities"] == ["gpu"] and len(gpu["device_ids"]) == 1
    assert services["engine"]["command"][-1] == "run_engine"
    assert services["web"]["command"][:3] == ["python", "manage.py", "serve"]
    worker = services["worker"]["command"]
    assert worker[:3] == ["python", "manage.py", "worker"]
    assert worker[worker.index("-Q") + 1] == "downloads,maintenance"
    loader = services["loader"]["command"]
    assert loader[loader.index("-Q") + 1] == "loads"
    # the analysis queue has a worker, which reads the captures and probes on the volume
    analyst = services["analyst"]["command"]
    assert analyst[:4] == ["celery", "-A", "millm_site", "worker"]
    assert analyst[analyst.index("-Q") + 1] == "analysis"
    assert "cache:/app" in services["analyst"]["volumes"]
    # the dashboards queue has a worker, whose checkpoints (DASHBOARD_DIR) are on the volume
    dashboarder = services["dashboarder"]["command"]
    assert dashboarder[dashboarder.index("-Q") + 1] == "dashboards"
    assert "cache:/app" in services["dashboarder"]["volumes"]
    # the experiments queue has a worker (its points are rows in PostgreSQL)
    experimenter = services["experimenter"]["command"]
    assert experimenter[experimenter.index("-Q") + 1] == "experiments"
    for name in ("web", "worker", "loader", "analyst", "engine", "migrate"):
        env = services[name]["environment"]
        assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} <= set(env), name
        unknown = [k for k in env if not _known(k)]
        assert not unknown, (name, unknown)
    # downloads (worker) and loads (engine) see the same files
    assert "cache:/app" in services["worker"]["volumes"]
    assert "cache:/app" in services["engine"]["volumes"]


def test_kubernetes_manifests():
    docs = _k8s()
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), d
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    deployments = by_kind["Deployment"]
    assert {"millm-web", "millm-worker", "millm-loader", "millm-analyst", "millm-engine"} <= set(deployments)
    [experimenter] = deployments["millm-experimenter"]["spec"]["template"]["spec"]["containers"]
    assert experimenter["command"][experimenter["command"].index("-Q") + 1] == "experiments"
    [analyst] = deployments["millm-analyst"]["spec"]["template"]["spec"]["containers"]
    assert analyst["command"][analyst["command"].index("-Q") + 1] == "analysis"
    assert analyst["volumeMounts"][0]["mountPath"] == "/app"
    assert {"millm-postgres", "millm-redis"} <= set(by_kind["StatefulSet"])
    assert {"millm-web", "millm-postgres", "millm-redis"} <= set(by_kind["Service"])
    engine = deployments["millm-engine"]["spec"]
    assert engine["replicas"] == 1 and engine["strategy"]["type"] == "Recreate"
    [container] = engine["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["command"][-1] == "run_engine"
    grace = int(by_kind["ConfigMap"]["millm-config"]["data"]["ENGINE_SHUTDOWN_GRACE_S"])
    assert engine["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    # selectors match their pod labels
    for d in [*deployments.values(), *by_kind["StatefulSet"].values()]:
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    for name in ("millm-config",):
        unknown = [k for k in by_kind["ConfigMap"][name]["data"] if not _known(k)]
        assert not unknown, unknown
    secret = by_kind["Secret"]["millm-secrets"]["stringData"]
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} <= set(secret)
    assert not [k for k in secret if not _known(k)]
    for d in deployments.values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            refs = {e.get("configMapRef", e.get("secretRef", {})).get("name") for e in c.get("envFrom", [])}
            assert refs == {"millm-config", "millm-secrets"}, d["metadata"]["name"]
            assert not [e["name"] for e in c.get("env", []) if not _known(e["name"])]
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize(
    "unit, command",
    [
        ("millm-web@.service", "manage.py serve"),
        ("millm-worker.service", "manage.py worker -Q downloads,maintenance"),
        ("millm-loader.service", "manage.py worker -Q loads"),
        ("millm-analysis.service", "celery -A millm_site worker -Q analysis"),
        ("millm-batches.service", "celery -A millm_site worker -Q batches"),
        ("millm-responses.service", "celery -A millm_site worker -Q responses"),
        ("millm-dashboards.service", "celery -A millm_site worker -Q dashboards"),
        ("millm-experiments.service", "celery -A millm_site worker -Q experiments"),
        ("millm-engine.service", "manage.py run_engine"),
    ],
)
def test_systemd_units(unit, command):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(DEPLOY / "systemd" / unit)
    service = parser["Service"]
    assert command in service["ExecStart"]
    assert service["EnvironmentFile"] == "/etc/millm/millm.env"
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert parser["Install"]["WantedBy"] == "multi-user.target"
    env = DEPLOY / "systemd" / "millm.env.example"
    names = [line.split("=", 1)[0] for line in env.read_text().splitlines() if line and not line.startswith("#")]
    assert all(_known(n) for n in names), names


def test_engine_unit_outlasts_the_shutdown_grace():
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / "millm-engine.service")
    assert int(parser["Service"]["TimeoutStopSec"]) > VARIABLES_BY_NAME["ENGINE_SHUTDOWN_GRACE_S"].default
    assert parser["Service"]["RestartPreventExitStatus"] == "3"


def _queues_consumed(commands: list[str]) -> set[str]:
    import re

    return {q for c in commands for m in re.finditer(r"-Q[ =]([\w,]+)", c) for q in m.group(1).split(",")}


def _worker_commands() -> dict[str, list[str]]:
    """Every Celery worker command of each deployment (systemd, compose, k8s, README)."""
    units = []
    for unit in (DEPLOY / "systemd").glob("*.service"):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.read(unit)
        units.append(parser["Service"]["ExecStart"])
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = [" ".join(s["command"]) for s in compose["services"].values() if isinstance(s.get("command"), list)]
    k8s = [
        " ".join(c["command"])
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / "worker.yaml").read_text())
        if doc
        for c in doc["spec"]["template"]["spec"]["containers"]
        if c.get("command")
    ]
    readme = [
        line
        for line in (DEPLOY.parent / "README.md").read_text().splitlines()
        if line.startswith(("celery ", "python manage.py worker "))
    ]
    return {"systemd": units, "compose": services, "k8s": k8s, "README": readme}


def test_every_routed_queue_has_a_worker_in_each_deployment():
    """A task routed to a queue nobody consumes never runs (a /v1 batch stayed
    'validating' under the README's and the systemd units' workers)."""
    from django.conf import settings

    routed = {r["queue"] for r in settings.CELERY_TASK_ROUTES.values()}
    routed.add(settings.CELERY_TASK_DEFAULT_QUEUE)
    for name, commands in _worker_commands().items():
        assert routed <= _queues_consumed(commands), (name, routed - _queues_consumed(commands))


def test_compose_has_no_repeated_keys():
    """PyYAML keeps the last of two equal keys; docker compose refuses the file."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        keys = [k.value for k, _ in node.value]
        repeated = {k for k in keys if keys.count(k) > 1}
        assert not repeated, (node.start_mark, repeated)
        return loader.construct_mapping(node, deep=deep)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    for path in [DEPLOY / "compose.yaml", *(DEPLOY / "k8s").glob("*.yaml")]:
        list(yaml.load_all(path.read_text(), Loader=Strict))


def test_download_and_load_workers_take_their_concurrency_from_the_settings():
    """MAX_DOWNLOAD_WORKERS and MAX_LOAD_WORKERS hold in every deployment: the workers of
    the downloads and loads queues are ``manage.py worker``, which sets Celery's
    concurrency from them, never a number written in the file, and no worker runs loads
    beside downloads (loads would then run at the download worker's concurrency)."""
    for name, commands in _worker_commands().items():
        for command in commands:
            queues = _queues_consumed([command])
            if {"downloads", "loads"} & queues:
                assert "manage.py worker" in command, (name, command)
                assert "--concurrency" not in command and " -c " not in command, (name, command)
                assert not {"downloads", "loads"} <= queues, (name, command)
        assert {"downloads", "loads"} <= _queues_consumed(commands), name


def test_manage_py_worker_runs_celery_at_the_settings_concurrency(settings):
    from django.core.management.base import CommandError

    from millm_site.management.commands.worker import celery_argv

    settings.MAX_LOAD_WORKERS = 3
    settings.MAX_DOWNLOAD_WORKERS = 5
    loads = celery_argv(["loads"], name="loader@%h", loglevel="INFO")
    assert loads[1:7] == ["-m", "celery", "-A", "millm_site", "worker", "-Q"]
    assert loads[7] == "loads" and "--concurrency=3" in loads and loads[loads.index("-n") + 1] == "loader@%h"
    assert "--concurrency=5" in celery_argv(["downloads", "maintenance"], name=None, loglevel="INFO")
    settings.MAX_LOAD_WORKERS = 1
    assert "--concurrency=1" in celery_argv(["loads"], name=None, loglevel="INFO")
    with pytest.raises(CommandError, match="one limited queue"):
        celery_argv(["downloads", "loads"], name=None, loglevel="INFO")
    with pytest.raises(CommandError, match="unknown queue"):
        celery_argv(["nonsense"], name=None, loglevel="INFO")


def test_manage_py_worker_prints_the_celery_command_from_the_environment():
    """The same through the command line, with the variable in the environment as the
    deployments set it (compose and k8s env, /etc/millm/millm.env)."""
    import os
    import subprocess
    import sys

    root = DEPLOY.parent
    env = {**os.environ, "MAX_LOAD_WORKERS": "4", "DJANGO_SETTINGS_MODULE": "millm_site.settings"}
    result = subprocess.run(
        [sys.executable, "manage.py", "worker", "-Q", "loads", "--print"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "-Q loads" in result.stdout and "--concurrency=4" in result.stdout


def test_manage_py_worker_starts_celery_at_max_load_workers(redis_url, pg_database_url, tmp_path):
    """A real worker: ``manage.py worker -Q loads`` becomes the Celery worker (exec, one
    process tree), whose own banner says the concurrency MAX_LOAD_WORKERS gave it."""
    import sys
    import time

    from tests.distributed.conftest import REPO, Proc, base_env

    env = base_env(
        REDIS_URL=redis_url,
        DATABASE_URL=pg_database_url,
        MILLM_DATA_DIR=str(tmp_path),
        MAX_LOAD_WORKERS="3",
        SECRET_KEY="x" * 50,
    )
    args = [sys.executable, str(REPO / "manage.py"), "worker", "-Q", "loads", "-n", "loader-test@%h"]
    proc = Proc("loader", args, env, tmp_path)
    try:
        deadline = time.monotonic() + 90
        text = ""
        while time.monotonic() < deadline and "ready." not in text and proc.alive():
            time.sleep(0.5)
            text = proc.log_path.read_text(errors="replace")
        assert "ready." in text, text[-3000:]
        assert re.search(r"concurrency:\s+3 \(prefork\)", text), text[-3000:]
        assert re.search(r"\.> loads\s", text), text[-3000:]
    finally:
        proc.stop()


def _dockerfile_stages() -> dict[str, str]:
    """deploy/Dockerfile's stages: name -> the stage's text (its FROM line included)."""
    stages: dict[str, str] = {}
    name = None
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        found = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if found:
            name = found.group(1)
            stages[name] = ""
        if name is not None:
            stages[name] += line + "\n"
    return stages


def _setup_files(role: str) -> list[str]:
    """The requirement files ``scripts/setup <role>`` installs."""
    script = (DEPLOY.parent / "scripts" / "setup").read_text()
    found = re.search(rf'^\s*{role}\) files="([^"]+)"', script, re.MULTILINE)
    assert found, role
    return found.group(1).split()


def _parents(stages: dict[str, str], name: str) -> list[str]:
    """``name`` and the stages it is built FROM, nearest first."""
    chain = [name]
    while True:
        parent = re.match(r"FROM\s+(\S+)", stages[chain[-1]], re.IGNORECASE).group(1)
        if parent not in stages:
            return chain
        chain.append(parent)


def test_the_engine_images_are_offered_with_vllm_and_with_llamacpp():
    """The engine image comes with each backend (issue 37, part 6): a target per backend,
    installing what ``scripts/setup vllm|llamacpp`` installs, running run_engine; compose
    builds the target MILLM_ENGINE_TARGET names (the plain engine by default) and the docs
    name every target."""
    stages = _dockerfile_stages()
    installed = {
        name: set(re.findall(r"-r\s+(requirements/\S+\.txt)", "".join(stages[s] for s in _parents(stages, name))))
        for name in stages
    }
    # the llama.cpp image installs what scripts/setup llamacpp installs, over the engine's
    assert set(_setup_files("llamacpp")) <= installed["engine-llamacpp"]
    assert "requirements/engine.txt" in installed["engine-llamacpp"]
    # the vLLM image installs requirements/engine.txt with vLLM, as scripts/setup vllm does;
    # its default vLLM is the CUDA build requirements/vllm.txt names for CUDA hosts, and
    # the CPU line it pins is the documented alternative
    vllm_txt = (DEPLOY.parent / "requirements" / "vllm.txt").read_text()
    (pinned,) = [line for line in vllm_txt.splitlines() if line and not line.startswith("#")]
    cuda = re.search(r"CUDA hosts: install `([^`]+)`", vllm_txt).group(1)
    assert set(_setup_files("vllm")) - {"requirements/vllm.txt"} <= installed["engine-vllm"]
    assert re.search(rf"ARG VLLM_PACKAGE={re.escape(cuda)}\n", stages["engine-vllm"])
    assert '"${VLLM_PACKAGE}"' in stages["engine-vllm"] and f"VLLM_PACKAGE={pinned}" in stages["engine-vllm"]
    for name in ("engine", "engine-vllm", "engine-llamacpp"):
        assert 'CMD ["python", "manage.py", "run_engine"]' in stages[name], name
        assert "USER millm" in stages[name] and "STOPSIGNAL SIGTERM" in stages[name], name
    # compose builds the engine from the target MILLM_ENGINE_TARGET names
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    target = compose["services"]["engine"]["build"]["target"]
    assert target == "${MILLM_ENGINE_TARGET:-engine}"
    docs = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    for name in ("engine-vllm", "engine-llamacpp", "MILLM_ENGINE_TARGET", "VLLM_PACKAGE", "LLAMACPP_CMAKE_ARGS"):
        assert name in docs, name


def _engines_routed(value: str) -> list[str]:
    from core.engines import parse_engine_models

    # compose's ${VAR:-default} with its default
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return [route.name for route in parse_engine_models(value)]


def test_every_deployment_runs_two_named_engines_that_engine_models_routes_to():
    """Several engines, one front (docs/deploy.md): compose, Kubernetes and systemd each run
    the default engine and a second one under its own name (its own streams), each with a
    GPU of its own, and ENGINE_MODELS routes models to both."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert services["engine-gpu1"]["command"][-3:] == ["run_engine", "--name", "gpu1"]
    cards = [
        services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name in ("engine", "engine-gpu1")
    ]
    assert cards[0] != cards[1]
    for name in ("web", "loader", "engine", "engine-gpu1"):
        assert set(_engines_routed(services[name]["environment"]["ENGINE_MODELS"])) == {"default", "gpu1"}, name

    deployments = {d["metadata"]["name"]: d for d in _k8s() if d["kind"] == "Deployment"}
    [second] = deployments["millm-engine-gpu1"]["spec"]["template"]["spec"]["containers"]
    assert second["command"][-3:] == ["run_engine", "--name", "gpu1"]
    assert second["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert deployments["millm-engine-gpu1"]["spec"]["replicas"] == 1
    [config] = [d for d in _k8s() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "millm-config"]
    assert set(_engines_routed(config["data"]["ENGINE_MODELS"])) == {"default", "gpu1"}

    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / "millm-engine-named@.service")
    assert parser["Service"]["ExecStart"].endswith("manage.py run_engine --name %i")
    assert parser["Service"]["RestartPreventExitStatus"] == "3"
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "systemd" / "millm.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(_engines_routed(env["ENGINE_MODELS"])) == {"default", "gpu1"}
