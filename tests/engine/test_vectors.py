"""Raw steering vectors (layout ``vector``, docs/steering.md "Raw steering vectors"): a
file of ``layer.<L>`` tensors attaches at a layer as an SAE with no encoder.  Every
expectation is computed here in float64 from the file the test wrote and the residual the
hook received; the hidden states used to compute vectors are compared with transformers'
own ``output_hidden_states``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from gpu_engine.api.errors import InvalidParameter, SAEFormatError, SAEIncompatible
from gpu_engine.api.protocol import (
    AttachSpec,
    FeatureControl,
    GenerationJob,
    HiddenStatesJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.sae import read_sae_metadata

from .helpers import block, capture
from .tolerances import EMBED_ATOL, HOOK_ATOL, HOOK_RTOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"
LAYERS = (1, 2)


@pytest.fixture(scope="module")
def vector_file(tmp_path_factory, tiny_assets):
    d = tiny_assets.models["tiny-llama"].hidden_size
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("vec") / "honesty.safetensors"
    save_file(
        {f"layer.{L}": rng.normal(size=d).astype(np.float32) for L in LAYERS},
        str(path),
        metadata={"model_name": "tiny-llama"},
    )
    return path


def file_vector(path, layer: int) -> np.ndarray:
    return load_file(str(path))[f"layer.{layer}"].astype(np.float64)


def steered(engine, model, layer: int, entry: SteeringEntry, max_tokens: int = 5):
    module = block(engine, model, layer)
    job = GenerationJob(
        "v",
        prompt=PROMPT,
        steering=SteeringSpec([entry]),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    with capture(module, before_engine=True) as raw, capture(module) as post:
        engine.generate_sync(job)
    return np.concatenate(raw, axis=0), np.concatenate(post, axis=0)


@pytest.fixture
def attached(engine, tiny_assets, vector_file):
    engine.attach(AttachSpec("vec", str(vector_file), 1, layout="vector"))
    return engine, tiny_assets.models["tiny-llama"]


def test_metadata_reads_the_layers_and_width_without_an_encoder(vector_file, tiny_assets):
    cfg = read_sae_metadata(vector_file)  # detected: no layout named
    assert (cfg.layout, cfg.d_in, cfg.d_sae, cfg.has_encoder, cfg.activation) == ("vector", 64, 1, False, "none")
    assert cfg.extra["layers"] == list(LAYERS) and cfg.layer is None and cfg.model_name == "tiny-llama"


def test_add_moves_the_block_output_by_exactly_strength_times_v_at_every_position(attached, vector_file):
    engine, model = attached
    raw, post = steered(engine, model, 1, SteeringEntry("vec", 1, {0: 3.0}))
    v = file_vector(vector_file, 1)  # the layer attached at, not the file's other vector
    np.testing.assert_allclose(post, raw + 3.0 * v, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert raw.shape[0] > 5  # the prompt's rows and the decode steps'
    # positive control: every row moved, by the layer-1 vector and not the layer-2 one
    assert (np.abs(post - raw).max(axis=-1) > POSITIVE_CONTROL_MIN).all()
    assert not np.allclose(post - raw, 3.0 * file_vector(vector_file, 2), atol=1e-3)
    status = {(a.sae_id, a.layer): a for a in engine.attachments()}[("vec", 1)]
    assert status.steering_apply_count > 0 and status.layout == "vector"


def test_ablate_removes_the_direction(attached, vector_file):
    engine, model = attached
    raw, post = steered(engine, model, 1, SteeringEntry("vec", 1, controls=[FeatureControl(0, mode="ablate")]))
    v = file_vector(vector_file, 1)
    unit = v / np.linalg.norm(v)
    np.testing.assert_allclose(post, raw - np.outer(raw @ unit, unit), atol=HOOK_ATOL, rtol=HOOK_RTOL)
    np.testing.assert_allclose(post @ unit, 0.0, atol=1e-4)
    assert np.abs(raw @ unit).max() > POSITIVE_CONTROL_MIN  # there was something to remove


@pytest.mark.parametrize(
    ("control", "param"),
    [
        (FeatureControl(0, mode="clamp", value=2.0), "steering.features.mode"),
        (FeatureControl(0, mode="scale", value=2.0), "steering.features.mode"),
        (FeatureControl(0, mode="add", value=2.0, condition=SteeringCondition(0, 0.1)), "steering.features.condition"),
    ],
)
def test_what_needs_an_encoder_is_refused_before_anything_runs(attached, control, param):
    engine, model = attached
    with capture(block(engine, model, 1)) as rows, pytest.raises(InvalidParameter) as exc:
        engine.generate_sync(
            GenerationJob(
                "r",
                prompt=PROMPT,
                steering=SteeringSpec([SteeringEntry("vec", 1, controls=[control])]),
                sampling=SamplingParams(max_tokens=2),
            )
        )
    assert exc.value.details["param"] == param
    assert "raw steering vector" in exc.value.message
    assert rows == []  # no forward ran


def test_monitoring_a_vector_is_refused(attached):
    engine, model = attached
    with capture(block(engine, model, 1)) as rows, pytest.raises(InvalidParameter) as exc:
        engine.generate_sync(
            GenerationJob(
                "m",
                prompt=PROMPT,
                monitor=MonitorSpec([MonitorEntry("vec", 1, top_k=1)]),
                sampling=SamplingParams(max_tokens=2),
            )
        )
    assert exc.value.details["param"] == "monitor.sae_id"
    assert rows == []


def test_a_layer_without_a_vector_and_a_wrong_width_are_refused_at_attach(engine, tiny_assets, vector_file, tmp_path):
    with pytest.raises(SAEIncompatible) as exc:
        engine.attach(AttachSpec("vec", str(vector_file), 3, layout="vector"))
    assert exc.value.details["layer"] == 3 and exc.value.details["layers"] == list(LAYERS)
    narrow = tmp_path / "narrow.safetensors"
    save_file({"layer.1": np.ones(32, dtype=np.float32)}, str(narrow))
    with pytest.raises(SAEIncompatible, match="d_in"):
        engine.attach(AttachSpec("narrow", str(narrow), 1))
    assert engine.attachments() == []
    report = engine.check_sae(str(vector_file), 3)
    assert not report.compatible and "no vector for layer 3" in report.errors[0]


def test_malformed_and_pickle_files_are_refused(engine, tmp_path):
    pickled = tmp_path / "vec.safetensors"
    torch.save({"layer.1": torch.ones(64)}, pickled)  # a pickle in a safetensors coat
    badname = tmp_path / "bad.safetensors"
    save_file({"direction": np.ones(64, dtype=np.float32)}, str(badname))
    matrix = tmp_path / "matrix.safetensors"
    save_file({"layer.1": np.ones((2, 64), dtype=np.float32)}, str(matrix))
    for path in (pickled, badname, matrix):
        with pytest.raises(SAEFormatError):
            engine.attach(AttachSpec("bad", str(path), 1, layout="vector"))
    assert engine.attachments() == []


@pytest.fixture(scope="module")
def hf_model(tiny_assets):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_assets.models["tiny-llama"].path), dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_hidden_states_equal_transformers_output_hidden_states(engine, hf_model, pooling):
    prompts = ["the cat sat", "a dog ran far away", [5, 17, 42, 9]]
    result = engine.hidden_states(HiddenStatesJob("h", prompts, layers=[2, 0], pooling=pooling))
    assert result.layers == [2, 0] and len(result.states) == 3
    for prompt, states in zip(prompts, result.states, strict=True):
        ids = prompt if isinstance(prompt, list) else engine.backend.encode_text(prompt)
        with torch.inference_mode():
            hs = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer, got in zip([2, 0], states, strict=True):
            h = hs[layer + 1][0].double().numpy()  # hidden_states[L + 1]: block L's output
            want = h[-1] if pooling == "last" else h.mean(axis=0)
            np.testing.assert_allclose(got, want, atol=EMBED_ATOL)


def test_hidden_states_refuses_an_unknown_layer(engine):
    with pytest.raises(InvalidParameter) as exc:
        engine.hidden_states(HiddenStatesJob("h", ["x"], layers=[4]))
    assert exc.value.details["param"] == "layers"
