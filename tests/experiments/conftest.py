"""Fixtures of the experiment tests: the live daphne of tests/v1 (the real ASGI app on a
loopback socket, its embedded engine float32 on CPU) with tiny-llama resident and its L1
ReLU SAE attached; runs go to the in-process ``experiments`` pool as the embedded server's
do. ``own``: the test's own float64 forward of the checkpoint (transformers, no engine
code), steered by its own hook adding ``strength · W_dec[i]`` at block 1's output."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
import torch

from tests.background import TERMINAL, run_ended, wait_until
from tests.engine.helpers import adding as _adding  # also tests/experiments/test_sweep.py's
from tests.published import recording
from tests.v1.conftest import KEYS, _v1_db, attach, keyed, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

SAE = "tiny-llama-L1-relu"
LAYER = 1
# KL from the engine's float32 log-softmax rows (renormalised in float64) against the
# test's float64 forward: float32 logits carry ~1e-6 relative error, so a KL of order 1
# agrees to ~1e-5 and a tiny one to ~1e-7 absolute
KL_RTOL, KL_ATOL = 1e-3, 2e-6
# a summed log-likelihood of up to 12 float32 log-probabilities against float64's
LOGLIK_ATOL = 2e-4
# a float32 encode against float64's (tests/engine/tolerances.py ENCODE_*)
ACT_ATOL = 2e-4


@pytest.fixture
def sae(llama):
    """tiny-llama resident with its L1 ReLU SAE attached at layer 1; every run ended after."""
    from experiments.models import ExperimentRun

    row = attach(SAE, LAYER)
    yield row
    ExperimentRun.objects.exclude(status__in=TERMINAL).update(status="cancelling")
    wait_until(lambda: not ExperimentRun.objects.exclude(status__in=TERMINAL).exists(), "every run to end")
    llama.wait_idle(60)


def wait_run(run_id: str, timeout_s: float = 300.0) -> Any:
    from experiments.models import ExperimentRun

    return run_ended(ExperimentRun, run_id, timeout_s)


def api(server: Any, method: str, path: str, body: Any = None, key: str | None = None, **kw: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {KEYS[key]}"} if key else {}
    resp = request(server.url, method, path, body, headers=headers, **kw)
    try:
        return resp.status, resp.json()
    except ValueError:
        return resp.status, resp.body


def ok(answer: tuple[int, Any], status: int = 200) -> Any:
    got, body = answer
    assert got == status, body
    assert body["success"] is True, body
    return body["data"]


def refused(answer: tuple[int, Any], status: int, code: str, param: str | None = None) -> dict:
    got, body = answer
    assert got == status, body
    assert body["success"] is False and body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["details"].get("param") == param, body
    return body["error"]


class Own:
    """The checkpoint in float64 and the SAE's decoder rows, read from the files."""

    def __init__(self, tiny_assets: Any) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tests.engine.helpers import RefSAE

        asset = tiny_assets.models["tiny-llama"]
        self.sae_asset = tiny_assets.saes[SAE]
        self.model = AutoModelForCausalLM.from_pretrained(str(asset.path), torch_dtype=torch.float64).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(asset.path))
        self.block = self.model.get_submodule(asset.layer_module_path(LAYER))
        self.ref = RefSAE(self.sae_asset)

    def log_softmax(self, ids: list[int], steer: dict[int, float] | None = None) -> np.ndarray:
        """Every row's next-token log-softmax, float64, with ``steer`` added at block 1."""
        hook = contextlib.nullcontext()
        if steer:
            hook = _adding(self.block, torch.tensor(self.ref.delta(steer), dtype=torch.float64))
        with torch.no_grad(), hook:
            logits = self.model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    def kl(self, prompt_ids: list[int], continuation: list[int], steer: dict[int, float]) -> np.ndarray:
        """KL(steered ‖ unsteered) at each row predicting a continuation token."""
        ids = [*prompt_ids, *continuation]
        p0, n = len(prompt_ids), len(continuation)
        s = self.log_softmax(ids, steer)[p0 - 1 : p0 - 1 + n]
        r = self.log_softmax(ids)[p0 - 1 : p0 - 1 + n]
        return (np.exp(s) * (s - r)).sum(axis=1)

    def loglik(self, prompt_ids: list[int], continuation: list[int]) -> np.ndarray:
        """Each continuation token's log-probability under the unsteered model."""
        ids = [*prompt_ids, *continuation]
        lsm = self.log_softmax(ids)
        p0 = len(prompt_ids)
        return np.array([lsm[p0 - 1 + k, t] for k, t in enumerate(continuation)])


@pytest.fixture(scope="session")
def own(tiny_assets):
    return Own(tiny_assets)


@pytest.fixture
def published(monkeypatch):
    """Every event published on this process's bus, in order, as (name, data)."""
    from core.runtime import runtime

    return recording(monkeypatch, runtime().events)
