"""Fixtures of the /api tests: the stand-in hub (session), hub settings pointed at it with
caches in a temporary folder, the embedded engine on CPU/float32, registered tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from tests.api.standin_hub import Repo, StandInHub
from tests.envelope import body, ok, refused  # noqa: F401 - re-exported to the tests
from tests.published import recording

MODEL_REPO = "millm-test/tiny-llama"
GATED_REPO = "millm-test/gated-llama"
SAE_REPO = "millm-test/saes"
GATED_SAE_REPO = "millm-test/gated-saes"
NPZ_PATH = "layer_2/width_256/average_l0_10/params.npz"
SAELENS_DIR = "tiny-llama-L1-relu"


def _param_count(model_dir: Path) -> int:
    from gpu_engine.api.model_dir import inspect_model_dir

    return inspect_model_dir(model_dir).param_count


@pytest.fixture(scope="session")
def standin_hub(tiny_assets):
    hub = StandInHub().start()
    llama = tiny_assets.models["tiny-llama"].path
    extra = {
        "pytorch_model.bin": b"\x80\x04 a pickle that must never be fetched",
        "original/consolidated.pth": b"never fetched either",
        "README.md": b"# tiny\n",
    }
    repo = hub.add_directory(MODEL_REPO, llama, extra=extra)
    repo.parameter_count = _param_count(llama)
    hub.add_directory(GATED_REPO, llama, gated=True)
    hub.add_directory("millm-test/tiny-gpt2", tiny_assets.models["tiny-gpt2"].path)
    saes = {a.name: a.path for a in tiny_assets.saes.values()}
    hub.add_repo(Repo(SAE_REPO, {"README.md": b"# saes\n"}))
    hub.add_directory(SAE_REPO, saes["tiny-llama-L1-relu"], prefix=f"{SAELENS_DIR}/")
    hub.add_directory(SAE_REPO, saes["tiny-llama-L3-relu"], prefix="tiny-llama-L3-relu/")
    npz = saes["tiny-llama-L2-jumprelu"] / "params.npz"
    hub.repos[SAE_REPO].files[NPZ_PATH] = npz.read_bytes()
    hub.add_repo(Repo(GATED_SAE_REPO, {NPZ_PATH: npz.read_bytes()}, gated=True))
    yield hub
    hub.stop()


@pytest.fixture
def hub(standin_hub, settings, tmp_path):
    """The stand-in hub, reset, with the server's hub settings pointing at it."""
    from core.runtime import runtime
    from registry import hub as hub_client

    standin_hub.reset()
    settings.HF_ENDPOINT = standin_hub.url
    settings.HF_TOKEN = ""
    settings.HF_RETRY_ATTEMPTS = 2
    settings.HF_CIRCUIT_FAIL_MAX = 2
    settings.HF_CIRCUIT_RESET_TIMEOUT_S = 30
    settings.HF_REQUEST_TIMEOUT_S = 5.0
    settings.MODEL_CACHE_DIR = str(tmp_path / "model_cache")
    settings.SAE_CACHE_DIR = str(tmp_path / "sae_cache")
    with runtime().replaced(hub=hub_client.HubBreakers()):  # breakers of these settings
        yield standin_hub
    standin_hub.reset()


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def published(monkeypatch):
    """Every event published, in order, as (name, data)."""
    from core import events

    return recording(monkeypatch, events)


@pytest.fixture
def engine_client(settings):
    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime

    settings.MILLM_ENGINE_DEVICE = "cpu"
    settings.MILLM_ENGINE_DTYPE = "float32"
    client = EmbeddedEngineClient()
    with runtime().replaced(engine=client):
        yield client
    client.shutdown()


@pytest.fixture
def tiny_llama(tiny_assets):
    from registry import services

    return services.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")


@pytest.fixture
def llama_saes(tiny_assets):
    from registry import services

    return {
        a.name: services.sae_register_local(local_path=str(a.path), name=a.name)
        for a in tiny_assets.saes_for("tiny-llama")
    }


@pytest.fixture
def mismatched_sae(tmp_path):
    """A registered SAELens SAE whose d_in (32) fits none of the tiny models (64)."""
    import numpy as np
    from safetensors.numpy import save_file

    from registry import services

    folder = tmp_path / "sae-d32"
    folder.mkdir()
    rng = np.random.default_rng(0)
    save_file(
        {
            "W_enc": rng.standard_normal((32, 16), dtype=np.float32),
            "W_dec": rng.standard_normal((16, 32), dtype=np.float32),
            "b_enc": np.zeros(16, np.float32),
            "b_dec": np.zeros(32, np.float32),
        },
        str(folder / "sae_weights.safetensors"),
    )
    (folder / "cfg.json").write_text(
        json.dumps(
            {
                "d_in": 32,
                "d_sae": 16,
                "architecture": "standard",
                "hook_name": "blocks.1.hook_resid_post",
                "model_name": "elsewhere",
                "normalize_activations": "none",
            }
        )
    )
    return services.sae_register_local(local_path=str(folder), name="d32")


def run_job(task, job_id: int, timeout_s: float = 30.0, **kwargs) -> str:
    """Run a job's task the way the test can see it.

    Inside the test's transaction (``db``) the dispatcher never fires (nothing commits),
    so the task runs here, in this thread. In a transactional test the dispatcher already
    handed it to the in-process pool after commit: wait for the job to end instead.
    """
    import time

    from django.db import connection

    from registry.models import Job

    if connection.in_atomic_block:
        return task(job_id, **kwargs)
    deadline = time.monotonic() + timeout_s
    while True:
        status = Job.objects.get(pk=job_id).status
        if status in Job.FINISHED:
            return "succeeded" if status == Job.Status.SUCCEEDED else "ended"
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(0.02)
