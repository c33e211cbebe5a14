"""The backend seam: the engine loads whatever the registry names, through the contract.

Backends registered here are the test's own: one wrapping the transformers runner under
another name (the engine must use it, not construct the transformers runner by name),
one whose packages are missing, one that breaks the contract.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gpu_engine.api import backends
from gpu_engine.backends import BackendEntry, backends_report, get_backend
from gpu_engine.backends.transformers.runner import TransformersRunner
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.capabilities import CAPABILITY_KEYS, Capabilities
from gpu_engine.api.errors import BackendUnavailable, InvalidParameter, ModelLoadFailed
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    SteeringSpec,
)

PROMPT = "the cat sat on the mat and"


class _PluggedCapabilities(Capabilities, kw_only=True):
    """A plugged-in backend's own key beside the ones every backend has."""

    plugged_only: bool = True


class _Plugged(TransformersRunner):
    """The transformers runner under its own name, with hooks it may refuse to install."""

    name = "plugged"
    install_hooks = True

    def capabilities(self) -> Capabilities:
        return _PluggedCapabilities(**msgspec.structs.asdict(super().capabilities()))

    def attach(self, attachment: Any) -> None:
        if self.install_hooks:
            super().attach(attachment)


class _Deaf(_Plugged):
    name = "deaf"
    install_hooks = False  # accepts attachments and applies nothing


def load_plugged(job, *, hooks):
    return _Plugged(job, hooks)


def load_deaf(job, *, hooks):
    return _Deaf(job, hooks)


def load_broken(job, *, hooks):
    return object()


@pytest.fixture
def registered(monkeypatch):
    """Register test backends for one test (the registry is module state)."""

    def add(name: str, loader: str, requires=("torch",), options=None) -> BackendEntry:
        entry = BackendEntry(
            name=name,
            summary="test",
            requires=requires,
            install=f"scripts/setup {name}",
            loader=loader,
            options=options or {},
        )
        monkeypatch.setitem(backends._BACKENDS, name, entry)
        return entry

    return add


def _job(asset, backend="transformers", **kw) -> LoadModelJob:
    return LoadModelJob("m", str(asset.path), dtype="float32", device="cpu", backend=backend, **kw)


def _greedy(rid: str, steering=None) -> GenerationJob:
    return GenerationJob(
        rid, prompt=PROMPT, steering=steering, sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )


def test_transformers_is_registered_and_reports_itself():
    entry = get_backend("transformers")
    assert entry.available and entry.missing() == []
    report = {b["name"]: b for b in backends_report()}
    assert report["transformers"]["available"] is True
    assert sorted(report["transformers"]["options"]) == [
        "fused_cpu_kernels",
        "kv_cache_mode",
        "lean_decode",
        "pack_cpu_weights",
        "prefix_cache_max_mb",
        "quantization",
        "speculative_model",
        "speculative_num_tokens",
        "torch_compile",
        "torch_compile_mode",
    ]
    assert report["transformers"]["quantizations"]["Q8"]["available"] is True
    assert report["transformers"]["quantizations"]["Q2"]["available"] is False


def test_an_unknown_backend_is_refused_by_name(tiny_assets):
    with Engine() as eng, pytest.raises(InvalidParameter) as err:
        eng.load_model(_job(tiny_assets.models["tiny-llama"], backend="nope"))
    assert err.value.details["param"] == "backend" and "transformers" in err.value.message


def test_a_plugged_in_backend_serves_through_the_contract(tiny_assets, registered):
    """The engine loads what the registry's loader returns: its name, its capabilities and
    its hooks are what the engine reports and uses."""
    registered("plugged", "tests.engine.test_backends:load_plugged")
    registered("deaf", "tests.engine.test_backends:load_deaf")
    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    steering = SteeringSpec.from_mapping({(sae.name, 1): {3: 8.0, 17: -5.0}})
    outputs = {}
    for name in ("transformers", "plugged", "deaf"):
        with Engine() as eng:
            status = eng.load_model(_job(model, backend=name))
            assert status.backend == name
            caps = status.batching["capabilities"]
            assert caps.get("plugged_only", False) is (name != "transformers")
            assert set(CAPABILITY_KEYS) <= set(caps)
            base = eng.generate_sync(_greedy("base")).token_ids
            eng.attach(AttachSpec(sae.name, str(sae.path), 1))
            steered = eng.generate_sync(_greedy("steered", steering)).token_ids
            outputs[name] = (base, steered)
    # same weights, same tokens; the steer changes them wherever the backend applies it
    assert outputs["plugged"] == outputs["transformers"]
    assert outputs["transformers"][0] != outputs["transformers"][1]
    # a backend that installs nothing leaves the output unsteered: attachments go through it
    assert outputs["deaf"][1] == outputs["deaf"][0] == outputs["transformers"][0]


def test_an_uninstalled_backend_is_refused_before_anything_drains(tiny_assets, registered):
    registered("absent", "tests.engine.test_backends:load_plugged", requires=("torch", "no_such_package_xyz"))
    model = tiny_assets.models["tiny-llama"]
    with Engine() as eng:
        eng.load_model(_job(model))
        with pytest.raises(BackendUnavailable) as err:
            eng.load_model(_job(model, backend="absent"))
        assert err.value.code == "backend_unavailable"
        assert err.value.details == {
            "backend": "absent",
            "missing": ["no_such_package_xyz"],
            "install": "scripts/setup absent",
        }
        assert "scripts/setup absent" in err.value.message
        # the resident model was not touched
        status = eng.status()
        assert (status.state, status.backend) == ("ready", "transformers")
        report = {b["name"]: b for b in status.backends}
        assert report["absent"]["available"] is False and report["absent"]["missing"] == ["no_such_package_xyz"]


def test_load_options_are_the_backends_own(tiny_assets, registered):
    model = tiny_assets.models["tiny-llama"]
    with Engine() as eng:
        with pytest.raises(InvalidParameter) as err:
            eng.load_model(_job(model, options={"tensor_parallel_size": 2}))
        assert err.value.details["param"] == "options.tensor_parallel_size"
        with pytest.raises(InvalidParameter) as err:
            eng.load_model(_job(model, options={"pack_cpu_weights": "yes"}))
        assert err.value.details["param"] == "options.pack_cpu_weights"
        assert eng.status().state == "empty"
        assert eng.load_model(_job(model, options={"pack_cpu_weights": False})).kernels == "default"


def test_a_loader_that_breaks_the_contract_fails_the_load_by_name(tiny_assets, registered):
    registered("broken", "tests.engine.test_backends:load_broken")
    with Engine() as eng, pytest.raises(ModelLoadFailed) as err:
        eng.load_model(_job(tiny_assets.models["tiny-llama"], backend="broken"))
    assert "attach" in err.value.message and "batch_runner" in err.value.message
    assert eng.status().state == "empty"


class _Mute(_Plugged):
    """Reports that it cannot monitor, return logprobs or embed."""

    name = "mute"

    def capabilities(self) -> Capabilities:
        return msgspec.structs.replace(
            super().capabilities(), per_request_monitoring=False, logprobs=False, embeddings=False
        )


def load_mute(job, *, hooks):
    return _Mute(job, hooks)


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "batched"])
def test_what_the_backend_cannot_do_is_refused_by_name_never_ignored(tiny_assets, registered, batched):
    from gpu_engine.api.protocol import BatchingOptions, EmbedJob, MonitorEntry, MonitorSpec

    registered("mute", "tests.engine.test_backends:load_mute")
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    with Engine(batching=BatchingOptions(enabled=batched)) as eng:
        eng.load_model(_job(tiny_assets.models["tiny-llama"], backend="mute"))
        eng.attach(AttachSpec(sae.name, str(sae.path), 1))
        monitored = GenerationJob(
            "mon",
            prompt=PROMPT,
            sampling=SamplingParams(max_tokens=4),
            monitor=MonitorSpec([MonitorEntry(sae.name, 1, top_k=3)]),
        )
        events = list(eng.generate(monitored).events(30))
        assert len(events) == 1 and events[0].code == "invalid_parameter"
        assert events[0].details["param"] == "monitor" and "mute" in events[0].message
        with_logprobs = GenerationJob("lp", prompt=PROMPT, sampling=SamplingParams(max_tokens=4, logprobs=True))
        [error] = list(eng.generate(with_logprobs).events(30))
        assert error.details["param"] == "logprobs"
        with pytest.raises(InvalidParameter) as err:
            eng.embed(EmbedJob("e", [PROMPT]))
        assert err.value.details["capability"] == "embeddings"
        # what it can do still runs: steering is on
        steering = SteeringSpec.from_mapping({(sae.name, 1): {3: 8.0}})
        assert len(eng.generate_sync(_greedy("ok", steering)).token_ids) == 8


def test_vllm_is_registered_and_without_vllm_refuses_with_its_install_command(tiny_assets, monkeypatch):
    entry = get_backend("vllm")
    assert entry.requires == ("vllm",) and entry.install == "scripts/setup vllm"
    assert entry.loader == "gpu_engine.backends.vllm:load"
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    report = {b["name"]: b for b in backends_report()}
    assert report["vllm"]["available"] is False and report["vllm"]["install"] == "scripts/setup vllm"
    with Engine() as eng, pytest.raises(BackendUnavailable) as err:
        eng.load_model(_job(tiny_assets.models["tiny-llama"], backend="vllm"))
    assert err.value.code == "backend_unavailable" and "scripts/setup vllm" in err.value.message


def test_every_backends_install_command_installs_what_it_requires():
    """The install command /api/health/inference shows is a scripts/setup role whose
    requirement files pin each package the backend requires (the transformers entry named
    the test role, which installs the development requirements)."""
    import re
    from pathlib import Path

    from gpu_engine.backends import backend_names, get_backend

    repo = Path(__file__).resolve().parents[2]
    setup = (repo / "scripts" / "setup").read_text()
    roles = dict(re.findall(r"^\s+(\w+)\) files=\"([^\"]+)\"", setup, re.MULTILINE))
    for entry in map(get_backend, backend_names()):
        command, _, role = entry.install.partition(" ")
        assert command == "scripts/setup" and role in roles, entry.install
        if role == "test":
            pytest.fail(f"{entry.name}: the test role installs the development requirements")
        pinned = "\n".join((repo / f).read_text().lower() for f in roles[role].split())
        pinned = pinned.replace("_", "-")
        for package in entry.requires:  # an import name; its distribution may extend it
            name = re.escape(package.replace("_", "-"))
            assert re.search(rf"^{name}(-[a-z0-9-]+)?==", pinned, re.MULTILINE), (entry.name, package)
