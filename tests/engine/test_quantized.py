"""Q8/Q4 loads on the transformers backend (gpu_engine/backends/transformers/quantization.py):
the weights really are int8/int4 in memory, steering and monitoring stay exact on the
quantized model, greedy decoding follows float32 closely, Q2 and pre-quantized checkpoints
that cannot load here are refused by name before anything unloads, and a pre-quantized
checkpoint loads at its own precision.

References come from outside the engine: sizes from the checkpoint's safetensors header,
steering deltas and SAE encodes from ``helpers.RefSAE`` (float64 numpy), and the
quantized model's own forward with the test's own hook."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import UnsupportedQuantization
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

from .helpers import RefSAE, add_delta, block, capture, count_forwards
from .tolerances import (
    ENCODE_ATOL,
    ENCODE_RTOL,
    HOOK_ATOL,
    HOOK_RTOL,
    POSITIVE_CONTROL_MIN,
    QUANTIZED_GREEDY_AGREEMENT_MIN,
)

PROMPTS = ("the cat sat on the mat and", "a quick brown fox jumps over", "once upon a time")
FEATURES = {3: 8.0, 17: -5.0}
# the linear layers of tiny-llama's decoder blocks (what Q8/Q4 quantize)
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_job(asset, quantization: str | None, path=None) -> LoadModelJob:
    return LoadModelJob(
        asset.name,
        str(path or asset.path),
        dtype="float32",
        device="cpu",
        options={"quantization": quantization} if quantization else {},
    )


@pytest.fixture(scope="module")
def q8_engine(tiny_assets):
    engine = Engine()
    engine.load_model(load_job(tiny_assets.models["tiny-llama"], "Q8"))
    yield engine
    engine.shutdown()


@pytest.fixture
def q8(q8_engine):
    q8_engine.detach(None)
    yield q8_engine
    q8_engine.detach(None)


def greedy(request_id: str, prompt: str = PROMPTS[0], max_tokens: int = 8, **kw) -> GenerationJob:
    return GenerationJob(
        request_id,
        prompt=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        **kw,
    )


def block_linear_shapes(asset) -> list[tuple[int, int]]:
    """(out, in) of every decoder-block linear weight, read from the checkpoint's header."""
    with safe_open(str(asset.path / "model.safetensors"), "pt") as f:
        return [
            tuple(f.get_slice(name).get_shape())
            for name in f.keys()
            if ".layers." in name and name.endswith(".weight") and name.split(".")[-2] in BLOCK_LINEARS
        ]


# ------------------------------------------------------------------ the weights


def test_q8_weights_are_int8_in_memory_and_the_status_says_so(q8, tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    shapes = block_linear_shapes(asset)
    assert len(shapes) == 7 * asset.num_layers
    n_weights = sum(o * i for o, i in shapes)
    rows = sum(o for o, _ in shapes)
    fp32 = Engine()
    try:
        plain = fp32.load_model(load_job(asset, None)).weights
    finally:
        fp32.shutdown()
    status = q8.status()
    weights = status.weights
    assert weights["quantization"] == "Q8" and weights["checkpoint_quantization"] is None
    assert weights["quantized_layers"] == len(shapes)
    # the head stays float32, packed where MILLM_ENGINE_PACK_WEIGHTS=auto's probe found packing faster
    probe = q8.backend.capabilities().kernel_probe
    head = "onednn_packed" if probe["packed_ms"] <= probe["default_ms"] else "default"
    assert status.kernels == f"q8_weight_only+{head}"
    # one int8 per block weight, one bf16 scale per output row; the rest stays float32
    assert weights["bytes_by_dtype"] == {
        "int8": n_weights,
        "bfloat16": 2 * rows,
        "float32": plain["bytes_by_dtype"]["float32"] - 4 * n_weights,
    }
    assert weights["bytes"] == plain["bytes"] - 3 * n_weights + 2 * rows
    assert plain["quantization"] is None and set(plain["bytes_by_dtype"]) == {"float32"}


def test_q4_weights_are_packed_int4(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    shapes = block_linear_shapes(asset)
    engine = Engine()
    try:
        weights = engine.load_model(load_job(asset, "Q4")).weights
        steered = _steered_matches_hand_hook(engine, tiny_assets)
    finally:
        engine.shutdown()
    assert weights["quantization"] == "Q4" and weights["quantized_layers"] == len(shapes)
    # two int4 values a byte; a bf16 scale and zero point per group of 32 inputs
    assert weights["bytes_by_dtype"]["uint8"] == sum(o * i for o, i in shapes) // 2
    assert weights["bytes_by_dtype"]["bfloat16"] == sum(o * (i // 32) * 2 * 2 for o, i in shapes)
    assert steered


# ------------------------------------------------------------------ steering and monitoring


def test_q8_steered_output_is_the_quantized_output_plus_the_delta(q8, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    q8.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    delta = RefSAE(asset).delta(FEATURES)
    module = block(q8, model, 1)
    steering = SteeringSpec.from_mapping({(asset.name, 1): FEATURES})
    with capture(module, before_engine=True) as raw, capture(module) as post, count_forwards(q8.backend.model) as n:
        out = q8.generate_sync(greedy("s", max_tokens=6, steering=steering))
    assert n[0] == out.forward_passes == 6 == len(raw) == len(post)
    assert [(c.layer, c.count) for c in out.steering_apply_count] == [(1, 6)]
    for r, p in zip(raw, post):
        np.testing.assert_allclose(p, r + delta, atol=HOOK_ATOL, rtol=HOOK_RTOL)
        assert np.abs(p - r).max(axis=-1).min() > POSITIVE_CONTROL_MIN
    # the raw rows are the quantized model's own (unsteered) output at that layer
    with capture(module) as unsteered:
        q8.generate_sync(greedy("u", max_tokens=1))
    np.testing.assert_allclose(raw[0], unsteered[0], atol=HOOK_ATOL, rtol=HOOK_RTOL)


def _steered_matches_hand_hook(engine, tiny_assets) -> bool:
    """Steered greedy tokens equal the same (quantized) model's forward with the test's
    own hook adding the decoder rows; the steer changes the tokens (positive control)."""
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    base = engine.generate_sync(greedy("base", max_tokens=12))
    with add_delta(block(engine, model, 1), RefSAE(asset).delta(FEATURES)):
        reference = engine.generate_sync(greedy("ref", max_tokens=12))
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    steering = SteeringSpec.from_mapping({(asset.name, 1): FEATURES})
    steered = engine.generate_sync(greedy("steered", max_tokens=12, steering=steering))
    engine.detach(None)
    assert reference.token_ids != base.token_ids
    return steered.token_ids == reference.token_ids


def test_q8_steering_matches_a_hand_made_hook_on_the_quantized_model(q8, tiny_assets):
    assert _steered_matches_hand_hook(q8, tiny_assets)


@pytest.mark.parametrize("read_point", ["pre_steering", "post_steering"])
def test_q8_monitoring_equals_an_independent_encode(q8, tiny_assets, read_point):
    model = tiny_assets.models["tiny-llama"]
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    ref = RefSAE(asset)
    q8.attach(AttachSpec(asset.name, str(asset.path), asset.layer))
    monitor = MonitorSpec(
        [MonitorEntry(asset.name, asset.layer, top_k=5, features=[0, 7, 100], read_point=read_point, positions="all")]
    )
    steering = SteeringSpec.from_mapping({(asset.name, asset.layer): {5: 3.0, 9: -2.0}})
    module = block(q8, model, asset.layer)
    with capture(module, before_engine=True) as raw, capture(module) as post:
        out = q8.generate_sync(greedy("m", max_tokens=5, monitor=monitor, steering=steering))
    rows = np.concatenate(raw if read_point == "pre_steering" else post, axis=0)
    acts = ref.encode(rows)  # float64, from the files, of the quantized model's residual
    fired = 0
    for rec in out.activations:
        np.testing.assert_allclose(
            [f.activation for f in rec.features], acts[rec.position][[0, 7, 100]], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )
        top = [(f.feature_index, f.activation) for f in rec.top_k]
        np.testing.assert_allclose(
            [v for _, v in top], acts[rec.position][[i for i, _ in top]], atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )
        expected = np.sort(acts[rec.position][acts[rec.position] > 0])[::-1][:5]
        np.testing.assert_allclose(
            sorted((v for _, v in top), reverse=True), expected, atol=ENCODE_ATOL, rtol=ENCODE_RTOL
        )
        fired += len(top)
    assert fired > 0 and [r.position for r in out.activations] == list(range(len(rows)))


# ------------------------------------------------------------------ fidelity to float32


def test_q8_greedy_follows_float32(q8, tiny_assets):
    """Teacher-forced over float32's own greedy continuations: the Q8 model picks float32's
    next token at most positions (QUANTIZED_GREEDY_AGREEMENT_MIN, tolerances.py), and it
    does not at every one (a Q8 load that silently ran float32 would)."""
    asset = tiny_assets.models["tiny-llama"]
    fp32 = Engine()
    try:
        fp32.load_model(load_job(asset, None))
        agree = total = 0
        for i, prompt in enumerate(PROMPTS):
            out = fp32.generate_sync(greedy(f"f{i}", prompt, max_tokens=16))
            ids = fp32.backend.encode_text(prompt) + out.token_ids
            with torch.inference_mode():
                ref = fp32.backend.full_logits(ids)
                got = q8.backend.full_logits(ids)
            n = len(ids) - len(out.token_ids)
            agree += int((got[n - 1 : -1].argmax(-1) == ref[n - 1 : -1].argmax(-1)).sum())
            total += len(out.token_ids)
            assert not torch.equal(got, ref)  # the quantized weights are in use
    finally:
        fp32.shutdown()
    assert agree / total >= QUANTIZED_GREEDY_AGREEMENT_MIN, (agree, total)


# ------------------------------------------------------------------ refusals and checkpoints


def test_q2_is_refused_by_name_before_the_resident_model_unloads(q8, tiny_assets):
    asset = tiny_assets.models["tiny-gpt2"]
    with pytest.raises(UnsupportedQuantization, match="2-bit") as refused:
        q8.load_model(load_job(asset, "Q2"))
    assert refused.value.details["quantization"] == "Q2"
    with pytest.raises(UnsupportedQuantization):
        q8.check_load(load_job(asset, "Q2"))
    assert q8.status().model_id == "tiny-llama" and q8.status().weights["quantization"] == "Q8"


def _copy_with_config(asset, tmp_path, **extra):
    target = tmp_path / "ckpt"
    shutil.copytree(asset.path, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **extra}))
    return target


def test_a_prequantized_checkpoint_this_host_cannot_load_is_refused_by_name(q8, tiny_assets, tmp_path):
    asset = tiny_assets.models["tiny-llama"]
    bnb = _copy_with_config(asset, tmp_path, quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(UnsupportedQuantization, match="bitsandbytes_8bit") as refused:
        q8.check_load(load_job(asset, None, bnb))
    assert refused.value.details["checkpoint_quantization"] == "bitsandbytes_8bit"
    with pytest.raises(UnsupportedQuantization, match="bitsandbytes"):
        q8.load_model(load_job(asset, "Q8", bnb))
    unknown = _copy_with_config(asset, tmp_path / "u", quantization_config={"quant_method": "made-up"})
    with pytest.raises(UnsupportedQuantization, match="made-up"):
        q8.check_load(load_job(asset, None, unknown))
    assert q8.status().model_id == "tiny-llama"  # nothing unloaded


def test_a_prequantized_checkpoint_loads_at_its_own_precision(tiny_assets, tmp_path):
    """A torchao int8 checkpoint registered as Q4 loads as int8 (never quantized again)."""
    from gpu_engine.backends.transformers.quantization import import_torchao_quietly

    import_torchao_quietly()
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    asset = tiny_assets.models["tiny-llama"]
    target = tmp_path / "torchao-int8"
    AutoModelForCausalLM.from_pretrained(
        str(asset.path), dtype=torch.float32, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    ).save_pretrained(target)
    for name in asset.path.iterdir():  # the tokenizer and chat template
        if not (target / name.name).exists():
            shutil.copy(name, target / name.name)
    shapes = block_linear_shapes(asset)
    engine = Engine()
    try:
        status = engine.load_model(load_job(asset, "Q4", target))
        out = engine.generate_sync(greedy("p", max_tokens=4))
    finally:
        engine.shutdown()
    weights = status.weights
    assert weights["checkpoint_quantization"] == "torchao" and weights["quantization"] is None
    # torchao's Int8Tensor: an int8 per weight and an int8 zero point per output row
    assert weights["bytes_by_dtype"]["int8"] == sum(o * i + o for o, i in shapes)
    assert "uint8" not in weights["bytes_by_dtype"]  # not re-quantized to int4
    assert len(out.token_ids) == 4
