"""Hidden-state capture (issue 15) against an independent float32 reference forward.

The reference is a second copy of the model loaded by the test (no oneDNN packing, no
engine hooks), run once over prompt + generated tokens with HF's
``output_hidden_states``: ``hidden_states[L + 1]`` is block L's output for every block but
the last (HF reports that one after the final norm, so the test reads it with its own
hook). Steered captures are compared with the reference steered by the test's own hook.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_engine.api.artifacts import load_capture, write_files
from gpu_engine.api.errors import CaptureTooLarge, InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    CaptureSpec,
    GenerationJob,
    SamplingParams,
    SteeringSpec,
)

from .helpers import RefSAE, count_forwards
from .tolerances import CAPTURE_ATOL, CAPTURE_RTOL

PROMPT = "a quick brown fox jumps over"
MODELS = ["tiny-llama", "tiny-gemma2", "tiny-gpt2"]


def job(request_id: str, capture: CaptureSpec | None = None, steering=None, max_tokens: int = 6) -> GenerationJob:
    return GenerationJob(
        request_id,
        prompt=PROMPT,
        capture=capture,
        steering=steering,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True),
    )


@pytest.fixture(scope="module")
def engines(engine_factory, llama_engine):
    made = {"tiny-llama": llama_engine}

    def get(name: str):
        if name not in made:
            made[name] = engine_factory(name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def reference(tiny_assets):
    made = {}

    def get(name: str):
        if name not in made:
            asset = tiny_assets.models[name]
            model = AutoModelForCausalLM.from_pretrained(
                str(asset.path), dtype=torch.float32, local_files_only=True
            ).eval()
            made[name] = (asset, model)
        return made[name]

    return get


def reference_blocks(asset, model, ids: list[int], delta=None, delta_layer: int | None = None) -> np.ndarray:
    """(num_layers, len(ids), d): every block's output, the steer added by the test."""
    last = model.get_submodule(asset.layer_module_path(asset.num_layers - 1))
    seen = []

    def keep(mod, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output)[0].detach().clone())

    def steer(mod, args, output):
        d = torch.tensor(delta, dtype=torch.float32)
        return (output[0] + d, *output[1:]) if isinstance(output, tuple) else output + d

    handles = [last.register_forward_hook(keep)]
    if delta is not None:
        # prepended: HF records hidden states with forward hooks of its own, installed at
        # the first call, and must record the steered output
        handles.append(
            model.get_submodule(asset.layer_module_path(delta_layer)).register_forward_hook(steer, prepend=True)
        )
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hs = [h[0] for h in out.hidden_states[1 : asset.num_layers]] + [seen[0]]
    return torch.stack(hs).double().numpy()


def close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, atol=CAPTURE_ATOL, rtol=CAPTURE_RTOL)


def expected_positions(mode: str, n_prompt: int, n_gen: int) -> list[int]:
    total = n_prompt + n_gen - 1
    return {
        "last": [total - 1],
        "all": list(range(total)),
        "prompt": list(range(n_prompt)),
        "completion": list(range(n_prompt - 1, total)),
    }[mode]


def captured_beside_plain(eng, plain_job, capture_job, positions: str):
    """Run ``plain_job`` and ``capture_job`` (the same request, capture armed) on ``eng``;
    check that arming capture changed nothing generated (tokens and their logprobs, bit for
    bit) and that the artifact holds the rows and token ids ``positions`` names. Returns
    (the captured run, its artifact, the positions)."""
    plain = eng.generate_sync(plain_job)
    out = eng.generate_sync(capture_job)
    assert out.token_ids == plain.token_ids
    assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in plain.logprobs]
    cap = load_capture(out.capture.data)
    pos = expected_positions(positions, out.usage.prompt_tokens, len(out.token_ids))
    assert cap.positions.tolist() == pos
    full = cap.meta["prompt_token_ids"] + out.token_ids
    assert cap.token_ids.tolist() == [full[p] for p in pos]
    return out, cap, pos


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("positions", ["last", "all", "prompt", "completion"])
def test_capture_equals_reference_and_changes_no_token(engines, reference, model_name, positions):
    eng = engines(model_name)
    asset, model = reference(model_name)
    layers = list(range(asset.num_layers))
    out, cap, pos = captured_beside_plain(
        eng, job("plain"), job("cap", CaptureSpec(layers=layers, positions=positions)), positions
    )
    n_prompt = out.usage.prompt_tokens
    full = cap.meta["prompt_token_ids"] + out.token_ids
    assert cap.meta["layers"] == layers and cap.meta["request_id"] == "cap" and cap.meta["model"] == model_name
    assert cap.meta["steering_hash"] is None and cap.meta["dtype"] == "float32"
    ref = reference_blocks(asset, model, full[: n_prompt + len(out.token_ids) - 1])
    for layer in layers:
        got = cap.hidden[layer].astype(np.float64)
        assert close(got, ref[layer][pos]), (layer, np.abs(got - ref[layer][pos]).max())
        # positive controls: zeros, or the neighbouring layer, must fail the same check
        assert not close(np.zeros_like(got), ref[layer][pos])
        assert not close(got, ref[(layer + 1) % len(layers)][pos])
    assert eng.hook_manager.armed_captures() == []  # no hook survives the request


def test_steered_request_captures_its_steered_stream(engine, tiny_assets, reference):
    asset, model = reference("tiny-llama")
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    features = {5: 3.0, 9: -2.0}
    steering = SteeringSpec.from_mapping({(sae.name, sae.layer): features})
    layers = [sae.layer, sae.layer + 1]
    out = engine.generate_sync(job("s", CaptureSpec(layers=layers, positions="all"), steering))
    cap = load_capture(out.capture.data, framework="torch")
    assert cap.meta["steering_hash"] == steering.canonical_hash()
    full = cap.meta["prompt_token_ids"] + out.token_ids
    ids = full[:-1]
    steered = reference_blocks(asset, model, ids, RefSAE(sae).delta(features), sae.layer)
    unsteered = reference_blocks(asset, model, ids)
    for layer in layers:
        got = cap.hidden[layer].double().numpy()
        assert close(got, steered[layer])
        assert not close(got, unsteered[layer])  # positive control: the steer shows


def test_bad_layers_and_oversized_captures_are_refused_before_any_forward(engine):
    n = engine.status().num_layers
    with count_forwards(engine.backend.model) as forwards:
        with pytest.raises(InvalidParameter) as bad:
            engine.generate_sync(job("x", CaptureSpec(layers=[0, n])))
        assert bad.value.param == "capture.layers"
        with pytest.raises(CaptureTooLarge) as big:
            engine.generate_sync(job("y", CaptureSpec(layers=list(range(n)), positions="all", max_bytes=1000)))
        d = engine.status().hidden_size
        # the estimate: every row it may take (prompt + max_tokens - 1) x layers x d x 4 bytes + 16 per row
        rows = big.value.details["rows"]
        assert big.value.details["estimate_bytes"] == rows * (n * d * 4 + 16) > 1000
        assert str(big.value.details["estimate_bytes"]) in big.value.message
    assert forwards[0] == 0
    with pytest.raises(InvalidParameter):
        CaptureSpec(layers=[])
    with pytest.raises(InvalidParameter):
        CaptureSpec(layers=[0], positions="middle")


def test_large_capture_is_written_to_the_directory(engine, tmp_path):
    out = engine.generate_sync(
        job("big", CaptureSpec(layers=[0, 1], positions="all", inline_max_bytes=100, directory=str(tmp_path)))
    )
    assert out.capture.data is None and out.capture.file == f"{out.capture.capture_id}.safetensors"
    path = tmp_path / out.capture.file
    assert path.stat().st_size == out.capture.nbytes
    assert (tmp_path / f"{out.capture.capture_id}.json").is_file()
    small = engine.generate_sync(job("small", CaptureSpec(layers=[0, 1], positions="all")))
    stored = load_capture(path)
    inline = load_capture(small.capture.data)
    for layer in (0, 1):
        np.testing.assert_array_equal(stored.hidden[layer], inline.hidden[layer])
    with pytest.raises(ValueError):
        write_files(tmp_path, "../escape", b"", {})


def test_a_cancelled_request_still_gets_its_rows(engine):
    stream = engine.generate(job("c", CaptureSpec(layers=[0], positions="completion"), max_tokens=50))
    events = []
    for ev in stream.events(timeout_s=30):
        events.append(ev)
        if len(events) == 3:
            stream.cancel()
    finish = events[-1]
    assert finish.finish_reason == "cancelled"
    cap = load_capture(finish.capture.data)
    n = len(finish.token_ids)
    assert 3 <= n < 50
    assert cap.positions.tolist() == list(range(finish.usage.prompt_tokens - 1, finish.usage.prompt_tokens - 1 + n))
