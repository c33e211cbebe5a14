"""A loaded backend is checked against ``ModelBackend``: a loader whose result lacks any
one member the runtime reads fails the load with ``model_load_failed`` naming it, and
nothing is resident afterwards."""

from __future__ import annotations

import pytest

from gpu_engine.api import backends
from gpu_engine.backends import BackendEntry
from gpu_engine.backends.transformers.runner import TransformersRunner
from gpu_engine.api.errors import ModelLoadFailed
from gpu_engine.api.protocol import LoadModelJob
from gpu_engine.runtime.engine import Engine

# members the engine reads that no earlier contract named (issue 32): a backend without
# them used to be probed with getattr and a default
LATE_MEMBERS = ("sae_device", "captures_in_workers", "job", "weights", "attention_geometry", "attention_scaling")


class _Without:
    """A loaded transformers runner seen through a view hiding one of its members."""

    def __init__(self, inner: TransformersRunner, hidden: str) -> None:
        self._inner, self._hidden = inner, hidden
        self.closed = False

    def __dir__(self):
        return [n for n in dir(self._inner) if n != self._hidden]

    def __getattr__(self, name):
        if name == self._hidden:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def close(self) -> None:
        _closed.append(self._hidden)
        self._inner.close()


_closed: list[str] = []


def load_without(job, *, hooks):
    return _Without(TransformersRunner(job, hooks), job.options["hide"])


@pytest.mark.parametrize("member", LATE_MEMBERS)
def test_a_backend_missing_one_member_fails_the_load_naming_it(tiny_assets, monkeypatch, member):
    monkeypatch.setitem(
        backends._BACKENDS,
        "partial",
        BackendEntry(
            name="partial",
            summary="test",
            requires=("torch",),
            install="scripts/setup partial",
            loader="tests.engine.test_backend_contract:load_without",
            options={"hide": str},
        ),
    )
    model = tiny_assets.models["tiny-llama"]
    _closed.clear()
    with Engine() as eng:
        with pytest.raises(ModelLoadFailed) as err:
            eng.load_model(
                LoadModelJob(
                    "m", str(model.path), dtype="float32", device="cpu", backend="partial", options={"hide": member}
                )
            )
        assert err.value.code == "model_load_failed"
        assert err.value.message.endswith(f"(missing: {member})")
        assert eng.status().state == "empty"
    assert _closed == [member]  # what it held was given back
