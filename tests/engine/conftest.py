"""Engine fixtures: one engine per model per module, cleaned between tests."""

from __future__ import annotations

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import LoadModelJob


@pytest.fixture(scope="module")
def engine_factory(tiny_assets):
    engines: list[Engine] = []

    def make(model_name: str, **kwargs) -> Engine:
        events = []
        eng = Engine(on_event=events.append, **kwargs)
        eng.events = events  # type: ignore[attr-defined]
        asset = tiny_assets.models[model_name]
        eng.load_model(LoadModelJob(model_name, str(asset.path), dtype="float32", device="cpu"))
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


@pytest.fixture(scope="module")
def llama_engine(engine_factory):
    return engine_factory("tiny-llama")


@pytest.fixture
def engine(llama_engine):
    """The tiny-llama engine with no SAE attached before and after the test."""
    llama_engine.detach(None)
    llama_engine.events.clear()
    yield llama_engine
    llama_engine.detach(None)
