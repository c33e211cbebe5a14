"""Refusals leave the model serving: bad SAEs, bad layers, OOM, drain timeouts."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpu_engine.api.errors import (
    EngineBusy,
    InsufficientMemory,
    InvalidFeatureIndex,
    SAEFormatError,
    SAEIncompatible,
    SAENotAttached,
)
from gpu_engine.api.protocol import AttachSpec, GenerationJob, SamplingParams, SteeringSpec
from offline_assets import build_sae

PROMPT = "once upon a time"


def greedy(rid: str, steering=None, max_tokens: int = 8) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        steering=steering,
    )


@pytest.fixture
def baseline(engine):
    return engine.generate_sync(greedy("base")).token_ids


def assert_serving(engine, baseline):
    assert engine.generate_sync(greedy("after")).token_ids == baseline
    assert engine.status().state == "ready"


def test_wrong_d_in_is_refused(engine, baseline, tmp_path):
    path = build_sae(
        tmp_path / "wide", d_in=48, d_sae=32, layer=1, layout="saelens", activation="relu", model_name="tiny-llama"
    )
    with pytest.raises(SAEIncompatible, match="d_in=48 does not match the model hidden size 64"):
        engine.attach(AttachSpec("wide", str(path), 1))
    assert engine.attachments() == []
    assert_serving(engine, baseline)


@pytest.mark.parametrize("layer", [4, 99])
def test_out_of_range_layer_is_refused(engine, baseline, tiny_assets, layer):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    with pytest.raises(SAEIncompatible, match=f"layer {layer} is out of range for a model with 4 layers"):
        engine.attach(AttachSpec(asset.name, str(asset.path), layer))
    assert_serving(engine, baseline)


def test_corrupt_sae_files_are_refused(engine, baseline, tiny_assets, tmp_path):
    import shutil

    for name, victim in (("tiny-llama-L1-relu", "sae_weights.safetensors"), ("tiny-llama-L2-jumprelu", "params.npz")):
        asset = tiny_assets.saes[name]
        bad = tmp_path / name
        shutil.copytree(asset.path, bad)
        data = (bad / victim).read_bytes()
        (bad / victim).write_bytes(data[: len(data) // 2])  # truncated download
        with pytest.raises(SAEFormatError):
            engine.attach(AttachSpec(name, str(bad), asset.layer))
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "params.npz").write_bytes(b"not a zip")
    with pytest.raises(SAEFormatError):
        engine.attach(AttachSpec("g", str(tmp_path / "garbage"), 1))
    assert engine.attachments() == []
    assert_serving(engine, baseline)


def test_attach_set_is_all_or_nothing(engine, baseline, tiny_assets):
    good = tiny_assets.saes["tiny-llama-L1-relu"]
    with pytest.raises(SAEIncompatible):
        engine.attach_set([AttachSpec(good.name, str(good.path), 1), AttachSpec("bad", str(good.path), 7)])
    assert engine.attachments() == []
    assert engine.hook_manager.installed() == []
    assert_serving(engine, baseline)


def test_steering_an_unattached_sae_or_bad_feature_is_a_request_error(engine, baseline, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    with pytest.raises(SAENotAttached):
        engine.generate_sync(greedy("x", SteeringSpec.from_mapping({(asset.name, 1): {1: 1.0}})))
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    with pytest.raises(InvalidFeatureIndex) as err:
        engine.generate_sync(greedy("y", SteeringSpec.from_mapping({(asset.name, 1): {asset.d_sae: 1.0}})))
    # the field's name as /v1 writes it, and the index under the key /api and /v1 report
    assert err.value.details == {
        "sae_id": asset.name,
        "feature_idx": asset.d_sae,
        "d_sae": asset.d_sae,
        "param": "steering.features",
    }
    assert_serving(engine, baseline)


def test_oom_during_a_steered_forward_detaches_and_keeps_serving(engine, baseline, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    module = engine.backend.model.get_submodule("model.layers.2")
    calls = [0]

    def explode(mod, args, output):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    handle = module.register_forward_hook(explode)
    try:
        with pytest.raises(InsufficientMemory):
            engine.generate_sync(greedy("boom", SteeringSpec.from_mapping({(asset.name, 1): {3: 5.0}})))
    finally:
        handle.remove()
    assert engine.attachments() == [] and engine.hook_manager.installed() == []
    names = [(e.name, e.data.get("reason")) for e in engine.events]
    assert ("sae:detached", "out_of_memory") in names
    assert any(n == "engine:out_of_memory" for n, _ in names)
    assert_serving(engine, baseline)


def test_attach_waits_for_the_generation_in_flight(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    stream = engine.generate(greedy("long", max_tokens=60))
    events = stream.events()
    assert next(events).type == "token"
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))  # drains the running request first
    rest = list(events)
    assert rest[-1].type == "finish" and len(rest[-1].token_ids) == 60
    assert rest[-1].steering_apply_count == []


def test_drain_wait_is_bounded(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    gate = threading.Event()
    stream = engine.generate(greedy("slow", max_tokens=200))
    module = engine.backend.model.get_submodule("model.layers.0")

    def stall(*args):
        gate.wait(5)  # keeps the forward pass in flight; returns None, output unchanged

    handle = module.register_forward_hook(stall)
    try:
        events = stream.events()
        next(events)
        t0 = time.monotonic()
        with pytest.raises(EngineBusy):
            engine.attach(AttachSpec(asset.name, str(asset.path), 1), timeout_s=0.3)
        assert time.monotonic() - t0 < 3
    finally:
        gate.set()
        handle.remove()
        stream.cancel()
    assert list(events)[-1].finish_reason == "cancelled"
    assert engine.attachments() == []  # the timed-out attach never ran
