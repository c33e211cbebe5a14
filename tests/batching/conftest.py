"""Batching fixtures: per model, one continuous-batching engine and one serial engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import AttachSpec, BatchingOptions, LoadModelJob

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
    size, input shape and start time (``time.monotonic``) of every forward: ``at[n]`` runs
    just before forward ``n`` (1-based) starts, so a request submitted there is admitted
    between that step and the next — the join step is exact, not a race with the test
    thread."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.at: dict[int, list[Callable[[], None]]] = {}
        self.batch_sizes: list[int] = []
        self.shapes: list[tuple[int, int]] = []
        self.started: list[float] = []
        self.lock = threading.Lock()

    def on(self, n: int, action: Callable[[], None]) -> None:
        self.at.setdefault(n, []).append(action)

    def _pre(self, module, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        with self.lock:
            self.started.append(time.monotonic())
            self.batch_sizes.append(int(ids.shape[0]))
            self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))
            n = len(self.batch_sizes)
        for action in self.at.pop(n, []):
            action()

    def prefills_then_decodes(self) -> tuple[int, list[int]]:
        """The rows prefilled before the first decode step (prompts of different lengths
        are prefilled in groups: ``prefill_groups``), and the rows of every decode step."""
        first_decode = next(i for i, (_, tokens) in enumerate(self.shapes) if tokens == 1)
        return (
            sum(rows for rows, _ in self.shapes[:first_decode]),
            [rows for rows, tokens in self.shapes if tokens == 1],
        )

    def run_together(
        self, send: Callable[[Any], None], items: Iterable[Any], *, on_release: Callable[[], None] | None = None
    ) -> None:
        """``send(item)`` for every item, each on a thread of its own, all released at
        once by a barrier (``on_release`` runs as they are), with this choreography
        installed until every thread has ended."""
        items = list(items)
        start = threading.Barrier(len(items), action=on_release)

        def run(item: Any) -> None:
            start.wait()
            send(item)

        threads = [threading.Thread(target=run, args=(item,)) for item in items]
        with self.installed():
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)

    @contextmanager
    def installed(self):  # type: ignore[no-untyped-def]
        # on the input embedding: every forward pass calls it with the input ids, through
        # model.forward or the lean step alike (lean.py runs every hook on it)
        handle = self.model.get_input_embeddings().register_forward_pre_hook(self._pre, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
