"""Fixtures of the steering-documents, monitoring and lease tests: one embedded engine
(CPU, float32) for the session with tiny-llama kept loaded, and per test the registry rows
that say so (the test's transaction rolls them back), nothing attached unless asked."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from tests.envelope import body, ok, refused  # noqa: F401 - re-exported to the tests


@pytest.fixture(scope="session")
def doc_engine():
    from core.engine_client import EmbeddedEngineClient

    client = EmbeddedEngineClient()
    yield client
    client.shutdown()


@pytest.fixture
def engine(doc_engine, settings):
    """The session's engine, installed as the server's engine client for this test."""
    from core.runtime import runtime

    settings.MILLM_ENGINE_DEVICE = "cpu"
    settings.MILLM_ENGINE_DTYPE = "float32"
    with runtime().replaced(engine=doc_engine):
        yield doc_engine


@dataclass
class Llama:
    model: Any
    saes: dict[str, Any]
    engine: Any

    def sae(self, name: str) -> Any:
        return self.saes[name]

    def attach(self, name: str, layer: int) -> Any:
        from orchestration.services import sae_attach

        sae = self.saes[name]
        sae_attach(sae=sae, layer=layer)
        return sae


def register_llama(tiny_assets) -> tuple[Any, dict[str, Any]]:
    from registry import services
    from registry.models import SAE, Model

    model = Model.objects.filter(name="tiny-llama").first() or services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama"
    )
    saes = {}
    for asset in tiny_assets.saes_for("tiny-llama"):
        saes[asset.name] = SAE.objects.filter(name=asset.name).first() or services.sae_register_local(
            local_path=str(asset.path), name=asset.name
        )
    return model, saes


def make_resident(engine, model) -> None:
    """tiny-llama resident in the engine and recorded as loaded, nothing attached."""
    from orchestration.services import model_load
    from registry.models import Model
    from registry.services import model_set_status

    if engine.status().model_id != model.name:
        model_load(model=model)
    else:
        engine.engine.detach(None)  # an earlier test's attachments (its rows are gone)
        model_set_status(model=model, status=Model.Status.LOADED, device="cpu", dtype="float32")
    model.refresh_from_db()


@pytest.fixture
def llama(engine, tiny_assets, db) -> Llama:
    model, saes = register_llama(tiny_assets)
    make_resident(engine, model)
    return Llama(model, saes, engine)


@pytest.fixture
def relu(llama):
    """tiny-llama-L1-relu (d_sae 256) attached at layer 1."""
    return llama.attach("tiny-llama-L1-relu", 1)


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def published(monkeypatch):
    """Every event published, in order, as (name, data)."""
    from core import events

    seen: list[tuple[str, dict]] = []

    def record(event: str, data: dict) -> None:
        seen.append((event, json.loads(json.dumps(data))))

    monkeypatch.setattr(events, "publish", record)
    return seen
