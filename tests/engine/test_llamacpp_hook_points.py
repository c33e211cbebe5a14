"""SAEs at every hook point on the llama.cpp backend, against the transformers backend on
the same float32 weights.

The tiny Llama checkpoint and its GGUF copy hold the same numbers; the transformers
backend's placement of each hook point is itself checked module by module in
test_hook_points.py, so it is the oracle here.  Per point (resid_pre of a middle layer
and of layer 0, attn_out, mlp_out, a transcoder; resid_post is test_llamacpp.py's), one
request that steers there and monitors there (pre-steering, every position), on
llama.cpp's serial path and its continuous batch (``eval_callback_per_row``), gives the
transformers backend's greedy tokens and logprobs (the steer reached the rest of the
graph from the node it was written to), monitored activations (the node read is the
point's) and steering counts; a positive control shows the steer changes the tokens,
and the node each point names is checked against llama.cpp's graph.  Under
``control_vector_swap`` the points a control vector cannot reach are refused at attach,
naming the mode and what the load supports.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.api.errors import InvalidParameter, SAEIncompatible
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)
from gpu_engine.runtime.engine import Engine

from .test_hook_points import FEATURES, REQUESTED, sae_at
from .test_llamacpp import ENCODE_ATOL, assert_same_generation, gguf_job

PROMPT = "the cat sat on the mat and"
# the graph node each case must land on (names read off llama.cpp's llama graph)
NODES = {
    "resid_pre": "l_out-1",
    "resid_pre_0": "embd",
    "attn_out": "attn_out-2",
    "mlp_out": "ffn_out-2",
    "mlp_transcoder": "ffn_out-2",
}


def greedy(rid: str, *, steering=None, monitor=None, n: int = 6) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5),
    )


@pytest.fixture(scope="module")
def gguf_serial(tiny_gguf):
    eng = Engine()
    eng.load_model(gguf_job(tiny_gguf))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def gguf_batched(tiny_gguf):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4))
    eng.load_model(gguf_job(tiny_gguf))
    yield eng
    eng.shutdown()


@pytest.fixture
def engines(engine, gguf_serial, gguf_batched):
    for e in (gguf_serial, gguf_batched):
        e.detach(None)
    yield engine, gguf_serial, gguf_batched
    for e in (gguf_serial, gguf_batched):
        e.detach(None)


def activations(result) -> np.ndarray:
    return np.array([[f.activation for f in rec.features] for rec in result.activations])


def test_the_per_row_load_reports_every_hook_point(gguf_serial):
    caps = gguf_serial.backend.capabilities()
    assert caps.steering_mode == "eval_callback_per_row"
    assert caps.hook_points == ["resid_post", "resid_pre", "attn_out", "mlp_out", "mlp_transcoder"]


@pytest.mark.parametrize("case", list(NODES))
def test_steering_and_monitoring_at_the_point_equal_the_transformers_backend(engines, tiny_assets, tmp_path, case):
    hf, gg, gb = engines
    path, _, layer = sae_at(tmp_path, tiny_assets, case)
    steering = SteeringSpec.from_mapping({("hp", layer): FEATURES})
    monitor = MonitorSpec(
        [MonitorEntry("hp", layer, top_k=5, features=REQUESTED, read_point="pre_steering", positions="all")]
    )
    spec = AttachSpec("hp", str(path), layer)
    hf.attach(spec)
    want = hf.generate_sync(greedy("hf", steering=steering, monitor=monitor))
    plain = hf.generate_sync(greedy("plain"))
    assert want.token_ids != plain.token_ids  # positive control: the steer changes the tokens
    assert (activations(want) > 0).any()  # features fire: the comparison is not all zeros
    for eng in (gg, gb):
        result = eng.attach(spec)
        assert (result.hook_point, result.layer_module_path) == (case.removesuffix("_0"), NODES[case])
        got = eng.generate_sync(greedy("gg", steering=steering, monitor=monitor))
        assert_same_generation(got, want)
        assert [(r.position, r.read_point) for r in got.activations] == [
            (r.position, r.read_point) for r in want.activations
        ]
        np.testing.assert_allclose(activations(got), activations(want), atol=ENCODE_ATOL)
        assert [(c.sae_id, c.layer, c.count) for c in got.steering_apply_count] == [
            (c.sae_id, c.layer, c.count) for c in want.steering_apply_count
        ]
        assert got.steering_apply_count[0].count == got.forward_passes
        # the write is gone for the next, unsteered request
        assert eng.generate_sync(greedy("after")).token_ids == plain.token_ids


@pytest.mark.parametrize("case", ["attn_out", "mlp_out", "mlp_transcoder"])
def test_the_last_layers_points_monitor_every_prompt_row(engines, tiny_assets, tmp_path, case):
    """llama.cpp keeps only the rows that produce logits after the last block's attention
    (its ffn_norm and ffn_out hold those alone; attn_out every row): a monitor there still
    reads every prompt position, as on transformers."""
    hf, gg, gb = engines
    path, _, _ = sae_at(tmp_path, tiny_assets, case)
    last = gg.backend.num_layers - 1
    spec = AttachSpec("hp", str(path), last)  # moved to the last layer: a warning only
    steering = SteeringSpec.from_mapping({("hp", last): FEATURES})
    monitor = MonitorSpec(
        [MonitorEntry("hp", last, top_k=5, features=REQUESTED, read_point="post_steering", positions="all")]
    )
    hf.attach(spec)
    want = hf.generate_sync(greedy("hf", steering=steering, monitor=monitor, n=3))
    assert len(want.activations) == len(hf.backend.encode_text(PROMPT)) + 3 - 1
    for eng in (gg, gb):
        eng.attach(spec)
        got = eng.generate_sync(greedy("gg", steering=steering, monitor=monitor, n=3))
        assert_same_generation(got, want)
        assert [r.position for r in got.activations] == [r.position for r in want.activations]
        np.testing.assert_allclose(activations(got), activations(want), atol=ENCODE_ATOL)


def test_a_batch_mixing_points_and_steerings_equals_each_request_alone(engines, tiny_assets, tmp_path):
    """Three SAEs at three points of one layer, each request steering one of them, one
    unsteered, in one continuous batch: each equals its run on the transformers backend."""
    hf, _, gb = engines
    cases = ("attn_out", "mlp_out", "mlp_transcoder")
    specs = []
    for case in cases:
        path, _, layer = sae_at(tmp_path, tiny_assets, case, name=f"sae-{case}")
        specs.append(AttachSpec(case, str(path), layer))
    hf.attach_set(specs)
    gb.attach_set(specs)
    jobs = [greedy(f"r{i}", steering=SteeringSpec.from_mapping({(c, 2): FEATURES})) for i, c in enumerate(cases)]
    jobs.append(greedy("plain", monitor=MonitorSpec([MonitorEntry("attn_out", 2, features=REQUESTED)])))
    want = [hf.generate_sync(job) for job in jobs]
    before = gb.backend.steering_forwards["eval_callback"]
    streams = [gb.generate(job) for job in jobs]
    for stream, w in zip(streams, want):
        got = stream.result(120)
        assert_same_generation(got, w)
        np.testing.assert_allclose(activations(got).reshape(-1), activations(w).reshape(-1), atol=ENCODE_ATOL)
    assert gb.backend.steering_forwards["eval_callback"] > before  # rows steered differently, per row


def test_control_vector_swap_refuses_what_a_control_vector_cannot_reach(engine, tiny_gguf, tiny_assets, tmp_path):
    eng = Engine()
    eng.load_model(gguf_job(tiny_gguf, steering_mode="control_vector_swap"))
    try:
        assert eng.backend.capabilities().hook_points == ["resid_post", "resid_pre"]
        # resid_pre of layer 2 is layer 1's output: steered there by a control vector
        path, _, layer = sae_at(tmp_path, tiny_assets, "resid_pre")
        spec = AttachSpec("pre", str(path), layer)
        engine.attach(spec)
        assert eng.attach(spec).layer_module_path == "l_out-1"
        steering = SteeringSpec.from_mapping({("pre", layer): FEATURES})
        want = engine.generate_sync(greedy("hf", steering=steering))
        before = eng.backend.steering_forwards["control_vector_swap"]
        got = eng.generate_sync(greedy("swap", steering=steering))
        assert_same_generation(got, want)
        assert eng.backend.steering_forwards["control_vector_swap"] - before == got.forward_passes
        eng.detach(None)
        for case in ("attn_out", "mlp_out", "mlp_transcoder"):
            path, _, layer = sae_at(tmp_path, tiny_assets, case)
            with pytest.raises(SAEIncompatible, match="control_vector_swap") as err:
                eng.attach(AttachSpec("x", str(path), layer))
            assert err.value.code == "sae_incompatible"
            assert err.value.details["supported"] == ["resid_post", "resid_pre"]
            assert eng.status().attachments == []
        # resid_pre of layer 0 is the embeddings: monitored there, but not steered
        path, _, _ = sae_at(tmp_path, tiny_assets, "resid_pre_0")
        assert eng.attach(AttachSpec("e", str(path), 0)).layer_module_path == "embd"
        with pytest.raises(InvalidParameter, match="embd"):
            eng.generate_sync(greedy("s", steering=SteeringSpec.from_mapping({("e", 0): FEATURES})))
    finally:
        eng.shutdown()


def test_a_graph_not_read_for_its_other_nodes_offers_the_layer_outputs_only(llamacpp):
    """The node names were read off llama.cpp's Llama graph; on another architecture
    (Gemma: its embeddings are scaled after ``embd``, its sub-block outputs normed after
    ``attn_out``/``ffn_out``) only the layer outputs are known to be the same points."""
    from gpu_engine.backends.llamacpp.backend import LlamaCppBackend

    fake = SimpleNamespace(
        name="llamacpp", steering_mode="eval_callback_per_row", steering_mode_reason="", architecture="gemma2"
    )
    fake.hook_points = LlamaCppBackend.hook_points.fget(fake)
    assert fake.hook_points == ("resid_post", "resid_pre")
    assert LlamaCppBackend.layer_module_path(fake, 2, "resid_pre") == "l_out-1"
    for point, layer in (("attn_out", 2), ("mlp_out", 2), ("mlp_transcoder", 2), ("resid_pre", 0)):
        with pytest.raises(SAEIncompatible, match="'gemma2' GGUF") as err:
            LlamaCppBackend.layer_module_path(fake, layer, point)
        assert err.value.details["supported"] == ["resid_post", "resid_pre"]
