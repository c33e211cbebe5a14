"""Batching fixtures: per model, one continuous-batching engine and one serial engine."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from gpu_engine.engine import Engine
from gpu_engine.protocol import AttachSpec, BatchingOptions, LoadModelJob

MODEL_SAE = {
    "tiny-llama": "tiny-llama-L1-relu",
    "tiny-gemma2": "tiny-gemma2-L1-jumprelu",
    "tiny-gpt2": "tiny-gpt2-L1-relu",
}


def load(tiny_assets, model_name: str, **engine_kwargs) -> Engine:
    events: list = []
    eng = Engine(on_event=events.append, **engine_kwargs)
    eng.events = events  # type: ignore[attr-defined]
    asset = tiny_assets.models[model_name]
    eng.load_model(LoadModelJob(model_name, str(asset.path), dtype="float32", device="cpu"))
    return eng


@pytest.fixture(scope="module")
def engines(tiny_assets):
    """``engines(model)`` → (batched engine, serial engine), each with the model's SAE
    attached; built once per module and model."""
    made: dict[str, tuple[Engine, Engine]] = {}

    def get(model_name: str) -> tuple[Engine, Engine]:
        if model_name not in made:
            sae = tiny_assets.saes[MODEL_SAE[model_name]]
            spec = AttachSpec(sae.name, str(sae.path), sae.layer)
            batched = load(tiny_assets, model_name, batching=BatchingOptions(enabled=True, max_batch_size=8))
            serial = load(tiny_assets, model_name)
            for eng in (batched, serial):
                eng.attach(spec)
            made[model_name] = (batched, serial)
        return made[model_name]

    yield get
    for pair in made.values():
        for eng in pair:
            eng.shutdown()


class Choreography:
    """Runs actions on the engine's worker at chosen forward passes, and records the batch
    size (and input shape) of every forward: ``at[n]`` runs just before forward ``n`` (1-based) starts, so a
    request submitted there is admitted between that step and the next — the join step is
    exact, not a race with the test thread."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.at: dict[int, list[Callable[[], None]]] = {}
        self.batch_sizes: list[int] = []
        self.shapes: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def on(self, n: int, action: Callable[[], None]) -> None:
        self.at.setdefault(n, []).append(action)

    def _pre(self, module, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        with self.lock:
            self.batch_sizes.append(int(ids.shape[0]))
            self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))
            n = len(self.batch_sizes)
        for action in self.at.pop(n, []):
            action()

    @contextmanager
    def installed(self):  # type: ignore[no-untyped-def]
        # on the input embedding: every forward pass calls it with the input ids, through
        # model.forward or the lean step alike (lean.py runs every hook on it)
        handle = self.model.get_input_embeddings().register_forward_pre_hook(self._pre, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
