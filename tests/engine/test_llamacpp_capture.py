"""Capture on the llama.cpp backend (issue 15) against independent float32 references.

The tiny Llama's float32 GGUF holds the checkpoint's numbers, so the references are the
transformers-side ones of ``test_capture``/``test_capture_qk``, computed in the test from
the checkpoint: HF's ``output_hidden_states`` (the last block read with the test's own
hook), steered by the test's own hook adding the SAE's delta; Q/K from each attention
module's input, its weights and the model's ``apply_rotary_pos_emb``.  llama.cpp's float32
kernels sum in another order than torch's (``LLAMACPP_CAPTURE_ATOL``), so the comparison
is within that tolerance, and each check is shown able to fail: zeros, the neighbouring
layer, un-rotated keys and llama.cpp's own interleaved head layout all fail it.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.artifacts import load_capture
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import CaptureTooLarge, InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    AttentionCaptureSpec,
    BatchingOptions,
    CaptureSpec,
    GenerationJob,
    SamplingParams,
    SteeringSpec,
)

from .helpers import RefSAE
from .test_capture import (  # noqa: F401
    captured_beside_plain,
    expected_positions,
    reference,
    reference_blocks,
)
from .test_capture_qk import attention_of, reference_qk
from .test_llamacpp import gguf_job
from .tolerances import (
    BATCH_ENCODE_ATOL,
    BATCH_ENCODE_RTOL,
    LLAMACPP_CAPTURE_ATOL,
    LLAMACPP_CAPTURE_RTOL,
)

PROMPT = "a quick brown fox jumps over"
PROMPTS = [PROMPT, "the cat sat on the mat and", "one two three four five six"]


def job(
    rid: str,
    capture: CaptureSpec | None = None,
    *,
    steering=None,
    prompt: str = PROMPT,
    max_tokens: int = 6,
) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=prompt,
        capture=capture,
        steering=steering,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True),
    )


def close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, atol=LLAMACPP_CAPTURE_ATOL, rtol=LLAMACPP_CAPTURE_RTOL)


def interleaved(x: np.ndarray) -> np.ndarray:
    """A head's halves (i, i + d/2) as llama.cpp's adjacent pairs (2i, 2i+1)."""
    d = x.shape[-1]
    return np.stack((x[..., : d // 2], x[..., d // 2 :]), axis=-1).reshape(x.shape)


@pytest.fixture(scope="module")
def gguf_engines(tiny_gguf):
    """{serial, batched, a serial engine on the Python eval callback (no C filter), and a
    serial engine whose decodes never fit the stage (the C filter hands captured nodes to
    Python, as it does for a decode too large to stage)}."""
    made = {
        "serial": Engine(),
        "batched": Engine(batching=BatchingOptions(enabled=True, max_batch_size=8)),
        "python_callback": Engine(),
        "unstaged": Engine(),
    }
    try:
        for name, eng in made.items():
            with pytest.MonkeyPatch.context() as mp:
                if name == "python_callback":
                    mp.setenv("MILLM_LLAMACPP_PYTHON_CALLBACK", "1")
                eng.load_model(gguf_job(tiny_gguf))
        assert made["python_callback"].backend.taps.native_filter is False
        made["unstaged"].backend.taps.stage_max_bytes = 0
        assert made["serial"].backend.taps.stages and made["batched"].backend.taps.stages
        yield made
    finally:
        for eng in made.values():
            eng.shutdown()


@pytest.fixture
def gguf(gguf_engines):
    for eng in gguf_engines.values():
        eng.detach(None)
    yield gguf_engines
    for eng in gguf_engines.values():
        eng.detach(None)


@pytest.mark.parametrize("which", ["serial", "batched", "python_callback", "unstaged"])
@pytest.mark.parametrize("positions", ["last", "all", "prompt", "completion"])
def test_capture_equals_reference_and_changes_no_token(gguf, reference, which, positions):  # noqa: F811
    eng = gguf[which]
    asset, model = reference("tiny-llama")
    layers = list(range(asset.num_layers))
    out, cap, pos = captured_beside_plain(
        eng, job("plain"), job("cap", CaptureSpec(layers=layers, positions=positions)), positions
    )
    n_prompt = out.usage.prompt_tokens
    full = cap.meta["prompt_token_ids"] + out.token_ids
    assert cap.meta["backend"] == "llamacpp" and cap.meta["layers"] == layers
    assert cap.meta["dtype"] == "float32" and cap.meta["steering_hash"] is None
    ref = reference_blocks(asset, model, full[: n_prompt + len(out.token_ids) - 1])
    for layer in layers:
        got = cap.hidden[layer].astype(np.float64)
        assert close(got, ref[layer][pos]), (layer, np.abs(got - ref[layer][pos]).max())
        # positive controls: zeros, or the neighbouring layer, fail the same check
        assert not close(np.zeros_like(got), ref[layer][pos])
        assert not close(got, ref[(layer + 1) % len(layers)][pos])


@pytest.mark.parametrize("which", ["serial", "batched", "python_callback", "unstaged"])
def test_qk_capture_equals_the_rotary_reference(gguf, reference, which):  # noqa: F811
    eng = gguf[which]
    asset, model = reference("tiny-llama")
    layers = list(range(asset.num_layers))
    plain = eng.generate_sync(job("plain"))
    out = eng.generate_sync(job("qk", CaptureSpec(attention=AttentionCaptureSpec(layers=layers, positions="all"))))
    assert out.token_ids == plain.token_ids
    assert [lp.logprob for lp in out.logprobs] == [lp.logprob for lp in plain.logprobs]
    cap = load_capture(out.capture.data)
    ids = (cap.meta["prompt_token_ids"] + out.token_ids)[:-1]
    assert cap.q_positions.tolist() == cap.k_positions.tolist() == list(range(len(ids)))
    att = cap.attention
    heads = model.config.num_attention_heads
    kv = model.config.num_key_value_heads
    assert (att["num_heads"], att["num_kv_heads"], att["heads"], att["kv_heads"]) == (
        heads,
        kv,
        list(range(heads)),
        list(range(kv)),
    )
    assert cap.meta["backend"] == "llamacpp" and cap.hidden == {}
    ref = reference_qk(asset, model, ids)
    for layer in layers:
        q, k = cap.q[layer].astype(np.float64), cap.k[layer].astype(np.float64)
        assert close(q, ref[layer][0]), (layer, np.abs(q - ref[layer][0]).max())
        assert close(k, ref[layer][1]), (layer, np.abs(k - ref[layer][1]).max())
        assert not close(k, ref[(layer + 1) % len(layers)][1])  # the neighbouring layer fails
        # llama.cpp's own layout (each head's halves interleaved by the GGUF converter) fails
        assert not close(q, interleaved(ref[layer][0]))
        assert att["scaling"][str(layer)] == pytest.approx(float(attention_of(model, asset, layer).scaling))
    unrotated = reference_qk(asset, model, ids, rotate=False)  # row 0 has angle 0
    assert not close(cap.k[0][1:].astype(np.float64), unrotated[0][1][1:])


def test_heads_map_to_kv_heads_as_transformers_does(gguf, reference):  # noqa: F811
    eng = gguf["serial"]
    asset, model = reference("tiny-llama")
    g = eng.backend.attention_geometry
    assert (g.num_heads, g.num_kv_heads) == (2, 1)  # GQA: both query heads read kv head 0
    spec = CaptureSpec(
        layers=[1],
        positions="last",
        attention=AttentionCaptureSpec(layers=[2], heads=[1], positions="prompt", q_positions="last_prompt"),
    )
    out = eng.generate_sync(job("h", spec))
    cap = load_capture(out.capture.data)
    n = out.usage.prompt_tokens
    assert cap.q_positions.tolist() == [n - 1] and cap.k_positions.tolist() == list(range(n))
    assert cap.q[2].shape == (1, 1, g.head_dim) and cap.k[2].shape == (n, 1, g.head_dim)
    assert cap.attention["heads"] == [1] and cap.attention["kv_heads"] == [0]
    ref = reference_qk(asset, model, (cap.meta["prompt_token_ids"] + out.token_ids)[:-1])
    assert close(cap.q[2][0, 0].astype(np.float64), ref[2][0][n - 1, 1])
    assert not close(cap.q[2][0, 0].astype(np.float64), ref[2][0][n - 1, 0])  # the other head
    assert close(cap.k[2][:, 0].astype(np.float64), ref[2][1][:n, 0])


@pytest.mark.parametrize("which", ["serial", "unstaged"])
@pytest.mark.parametrize("attach_layer, path", [(1, "control_vector"), (0, "eval_callback")])
def test_a_steered_request_captures_its_steered_stream(
    gguf,
    tiny_assets,
    reference,  # noqa: F811
    attach_layer,
    path,
    which,
):
    """Steering first, on both of llama.cpp's steering paths: a control vector (layer 1)
    and the eval callback (layer 0, which no control vector reaches; a staged capture is
    copied after the callback added the delta)."""
    eng = gguf[which]
    asset, model = reference("tiny-llama")
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    eng.attach(AttachSpec(sae.name, str(sae.path), attach_layer))
    features = {5: 3.0, 9: -2.0}
    steering = SteeringSpec.from_mapping({(sae.name, attach_layer): features})
    layers = [attach_layer, attach_layer + 1]
    before = dict(eng.backend.steering_forwards)
    out = eng.generate_sync(job("s", CaptureSpec(layers=layers, positions="all"), steering=steering))
    assert eng.backend.steering_forwards[path] - before[path] == out.forward_passes
    cap = load_capture(out.capture.data)
    assert cap.meta["steering_hash"] == steering.canonical_hash()
    ids = (cap.meta["prompt_token_ids"] + out.token_ids)[:-1]
    steered = reference_blocks(asset, model, ids, RefSAE(sae).delta(features), attach_layer)
    unsteered = reference_blocks(asset, model, ids)
    for layer in layers:
        got = cap.hidden[layer].astype(np.float64)
        assert close(got, steered[layer]), (layer, np.abs(got - steered[layer]).max())
        assert not close(got, unsteered[layer])  # positive control: the steer shows


def test_each_capture_in_a_mixed_batch_equals_its_solo_capture(gguf, tiny_assets, monkeypatch):
    batched, serial = gguf["batched"], gguf["serial"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    for eng in (batched, serial):
        eng.attach(AttachSpec(sae.name, str(sae.path), 1))
    steer = {
        "a": SteeringSpec.from_mapping({(sae.name, 1): {3: 5.0}}),
        "b": SteeringSpec.from_mapping({(sae.name, 1): {7: -4.0}}),
    }
    jobs = [
        job(
            "all",
            CaptureSpec(layers=[0, 1, 2, 3], positions="all"),
            steering=steer["a"],
            prompt=PROMPTS[0],
            max_tokens=8,
        ),
        job("plain", None, prompt=PROMPTS[1], max_tokens=8),
        job(
            "completion",
            CaptureSpec(layers=[1, 3], positions="completion"),
            steering=steer["b"],
            prompt=PROMPTS[2],
            max_tokens=8,
        ),
        job(
            "qk",
            CaptureSpec(
                layers=[2],
                positions="last",
                attention=AttentionCaptureSpec(layers=[0, 3], heads=[1], positions="all", q_positions="completion"),
            ),
            prompt=PROMPTS[1],
            max_tokens=8,
        ),
        job("prompt", CaptureSpec(layers=[3], positions="prompt"), prompt=PROMPTS[2], max_tokens=5),
    ]
    solo = {j.request_id: serial.generate_sync(j, timeout_s=60) for j in jobs}
    ctx = batched.backend.context
    widest = [0]
    decode = ctx.decode

    def counting(tokens):
        widest[0] = max(widest[0], len({t[2] for t in tokens}))
        return decode(tokens)

    monkeypatch.setattr(ctx, "decode", counting)
    before = dict(batched.backend.steering_forwards)
    streams = [batched.generate(j) for j in jobs]
    mixed = {j.request_id: s.result(60) for j, s in zip(jobs, streams)}
    assert widest[0] >= 3  # the requests did share forwards
    assert batched.backend.steering_forwards["eval_callback"] > before["eval_callback"]
    for rid, got in mixed.items():
        want = solo[rid]
        assert got.token_ids == want.token_ids, rid
        if want.capture is None:
            assert got.capture is None
            continue
        g, w = load_capture(got.capture.data), load_capture(want.capture.data)
        assert g.positions.tolist() == w.positions.tolist() and g.layers == w.layers, rid
        for layer in g.layers:
            np.testing.assert_allclose(
                g.hidden[layer],
                w.hidden[layer],
                atol=BATCH_ENCODE_ATOL,
                rtol=BATCH_ENCODE_RTOL,
                err_msg=f"{rid} layer {layer}",
            )
        if w.attention is not None:
            assert g.q_positions.tolist() == w.q_positions.tolist()
            assert g.k_positions.tolist() == w.k_positions.tolist()
            for layer in w.q:
                np.testing.assert_allclose(g.q[layer], w.q[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL)
                np.testing.assert_allclose(g.k[layer], w.k[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL)


def test_a_staged_capture_runs_no_python_inside_the_decode(
    gguf,
    reference,
    monkeypatch,  # noqa: F811
):
    """With the C filter, captured nodes are copied in C: a capture-only request never
    reaches the Python side of the callback, which the test breaks (the unstaged engine,
    which reads them there, then fails)."""
    asset, model = reference("tiny-llama")
    layers = list(range(asset.num_layers))

    def broken(*args, **kwargs):
        raise AssertionError("the Python side of the eval callback ran")

    for name in ("serial", "unstaged"):
        monkeypatch.setattr(gguf[name].backend.taps, "_apply", broken)
    spec = CaptureSpec(layers=layers, positions="last")
    out = gguf["serial"].generate_sync(job("staged", spec))
    cap = load_capture(out.capture.data)
    ids = (cap.meta["prompt_token_ids"] + out.token_ids)[:-1]
    ref = reference_blocks(asset, model, ids)
    for layer in layers:
        assert close(cap.hidden[layer].astype(np.float64), ref[layer][[len(ids) - 1]])
    with pytest.raises(Exception, match="Python side of the eval callback ran"):
        gguf["unstaged"].generate_sync(job("unstaged", spec))


def test_a_node_that_does_not_fit_the_stage_fails_the_request(gguf):
    """The C filter refuses a node whose rows are not the width it was told, instead of
    copying past the stage: the request fails with the reason, and the next one runs."""
    eng = gguf["serial"]
    d = eng.status().hidden_size
    eng.backend.taps.filter.row_floats[0] = d + 1
    try:
        with pytest.raises(Exception, match="l_out-0 is not a dense float32 block"):
            eng.generate_sync(job("wide", CaptureSpec(layers=[0])))
    finally:
        eng.backend.taps.filter.row_floats[0] = d
    assert eng.generate_sync(job("ok", CaptureSpec(layers=[0]))).capture is not None


def test_bad_layers_heads_and_sizes_are_refused_before_any_forward(gguf, monkeypatch):
    eng = gguf["serial"]
    n = eng.status().num_layers
    heads = eng.backend.attention_geometry.num_heads
    decodes = []
    decode = eng.backend.context.decode
    monkeypatch.setattr(eng.backend.context, "decode", lambda tokens: (decodes.append(1), decode(tokens)))
    for spec, param in (
        (CaptureSpec(layers=[0, n]), "capture.layers"),
        (CaptureSpec(attention=AttentionCaptureSpec(layers=[n])), "capture.attention.layers"),
        (
            CaptureSpec(attention=AttentionCaptureSpec(layers=[0], heads=[heads])),
            "capture.attention.heads",
        ),
    ):
        with pytest.raises(InvalidParameter) as bad:
            eng.generate_sync(job("x", spec))
        assert bad.value.param == param
    with pytest.raises(CaptureTooLarge):
        eng.generate_sync(job("y", CaptureSpec(layers=list(range(n)), positions="all", max_bytes=1000)))
    assert decodes == []
    assert eng.generate_sync(job("ok", CaptureSpec(layers=[0]))).capture is not None
    assert decodes  # the counter counts


def test_a_small_stage_budget_keeps_the_rows_and_the_memory_bound(gguf, monkeypatch):
    """With a stage budget of 8 tokens, a long prompt's prefill reads its captured nodes in
    Python and the decode steps stage theirs: the capture equals the one taken with the
    default budget, and the stage buffers never pass the budget."""
    eng, ref_eng = gguf["serial"], gguf["batched"]
    taps = eng.backend.taps
    n = eng.status().num_layers
    widths = sum(taps.rows)
    budget = n * 8 * widths * 4
    monkeypatch.setattr(taps, "stage_max_bytes", budget)
    spec = CaptureSpec(
        layers=list(range(n)), positions="all", attention=AttentionCaptureSpec(layers=[0, n - 1], positions="all")
    )
    long_prompt = " ".join(PROMPTS)  # more than 8 tokens
    got = eng.generate_sync(job("small", spec, prompt=long_prompt, max_tokens=5))
    want = ref_eng.generate_sync(job("default", spec, prompt=long_prompt, max_tokens=5))
    assert got.usage.prompt_tokens > 8 and got.token_ids == want.token_ids
    held = sum(b.nbytes for b in taps._stage if b is not None)
    assert 0 < held <= budget
    g, w = load_capture(got.capture.data), load_capture(want.capture.data)
    assert g.positions.tolist() == w.positions.tolist()
    for layer in g.layers:
        np.testing.assert_allclose(g.hidden[layer], w.hidden[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL)
    for layer in w.q:
        np.testing.assert_allclose(g.q[layer], w.q[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL)
        np.testing.assert_allclose(g.k[layer], w.k[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL)
