"""Attention Q/K capture (issue 15) against an independent float32 reference.

The reference is computed in the test: a second copy of the model (no oneDNN packing, no
engine hooks) runs once over prompt + generated tokens; a pre-hook keeps what each
attention module receives, and the test applies that module's own weights and the
model's rotary function (``apply_rotary_pos_emb`` with the model's ``rotary_emb`` at
positions 0..T-1) itself.  GPT-2 has no rotary: its q/k are the ``c_attn`` split.
Positive controls: the neighbouring layer's keys, and un-rotated keys, fail the check.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.errors import CaptureTooLarge, InvalidParameter
from gpu_engine.api.protocol import AttentionCaptureSpec, CaptureSpec, GenerationJob, SamplingParams

from .helpers import count_forwards
from .test_capture import PROMPT, engines, reference  # noqa: F401  (fixtures)
from .tolerances import CAPTURE_ATOL, CAPTURE_RTOL

MODELS = ["tiny-llama", "tiny-gemma2", "tiny-gpt2"]


def job(request_id: str, capture: CaptureSpec | None = None, max_tokens: int = 6, prompt: str = PROMPT):
    return GenerationJob(
        request_id,
        prompt=prompt,
        capture=capture,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True),
    )


def attention_of(model, asset, layer: int):
    block = model.get_submodule(asset.layer_module_path(layer))
    return getattr(block, "self_attn", None) or block.attn


def reference_qk(asset, model, ids: list[int], *, rotate: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``{layer: (q (T, heads, d), k (T, kv_heads, d))}`` from each attention module's
    input, its weights and the model's rotary function, computed here."""
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(asset.num_layers):

        def keep(mod, args, kwargs, layer=layer):
            x = args[0] if args else kwargs["hidden_states"]
            inputs[layer] = x[0].detach().clone()

        handles.append(attention_of(model, asset, layer).register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    out = {}
    t = len(ids)
    with torch.no_grad():
        for layer, x in inputs.items():
            attn = attention_of(model, asset, layer)
            if hasattr(attn, "q_proj"):
                d = attn.head_dim
                q = (x @ attn.q_proj.weight.T).view(t, heads, d).transpose(0, 1)[None]
                k = (x @ attn.k_proj.weight.T).view(t, kv, d).transpose(0, 1)[None]
                if rotate:
                    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
                    cos, sin = model.model.rotary_emb(x[None], torch.arange(t)[None])
                    q, k = rope(q, k, cos, sin)
                q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            else:  # GPT-2: Conv1D c_attn = x @ W + b, split into q, k, v; no rotary
                qkv = x @ attn.c_attn.weight + attn.c_attn.bias
                d = qkv.shape[-1] // 3 // heads
                q, k, _ = qkv.split(heads * d, dim=-1)
                q, k = q.view(t, heads, d), k.view(t, heads, d)
            out[layer] = (q.double().numpy(), k.double().numpy())
    return out


def close(a, b) -> bool:
    return a.shape == b.shape and np.allclose(a, b, atol=CAPTURE_ATOL, rtol=CAPTURE_RTOL)


@pytest.mark.parametrize("model_name", MODELS)
def test_qk_capture_equals_reference_and_changes_no_token(engines, reference, model_name):  # noqa: F811
    eng = engines(model_name)
    asset, model = reference(model_name)
    layers = list(range(asset.num_layers))
    plain = eng.generate_sync(job("plain"))
    impl = eng.backend.model.config._attn_implementation
    spec = CaptureSpec(attention=AttentionCaptureSpec(layers=layers, positions="all"))
    out = eng.generate_sync(job("qk", spec))
    assert out.token_ids == plain.token_ids
    # with the tap armed the step keeps PyTorch's calls instead of the C kernels
    # (cpu_fused.py): the same arithmetic, summed in another order, so the last bits move
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-5)
    cap = load_capture(out.capture.data)
    full = cap.meta["prompt_token_ids"] + out.token_ids
    ids = full[:-1]
    pos = list(range(len(ids)))
    assert cap.q_positions.tolist() == pos and cap.k_positions.tolist() == pos
    att = cap.attention
    g = eng.backend.attention_geometry
    assert att["heads"] == list(range(g.num_heads)) and att["kv_heads"] == list(range(g.num_kv_heads))
    assert cap.hidden == {} and cap.meta["layers"] == []
    ref = reference_qk(asset, model, ids)
    for layer in layers:
        q, k = cap.q[layer].astype(np.float64), cap.k[layer].astype(np.float64)
        assert close(q, ref[layer][0]), (layer, np.abs(q - ref[layer][0]).max())
        assert close(k, ref[layer][1]), (layer, np.abs(k - ref[layer][1]).max())
        # positive controls: the neighbouring layer's keys fail the same check
        assert not close(k, ref[(layer + 1) % len(layers)][1])
        assert att["scaling"][str(layer)] == pytest.approx(float(attention_of(model, asset, layer).scaling))
    if model_name != "tiny-gpt2":  # un-rotated keys fail (row 0 has angle 0: compare the rest)
        plain_ref = reference_qk(asset, model, ids, rotate=False)
        assert not close(cap.k[0][1:].astype(np.float64), plain_ref[0][1][1:])
    assert eng.backend.qk_taps.armed() == [] and eng.hook_manager.armed_captures() == []
    assert eng.backend.model.config._attn_implementation == impl  # the tap is gone


def test_heads_select_kv_heads_and_positions_differ_for_q_and_k(engines, reference):  # noqa: F811
    eng = engines("tiny-llama")
    asset, model = reference("tiny-llama")
    g = eng.backend.attention_geometry
    assert g.num_heads == 2 and g.num_kv_heads == 1  # GQA: both query heads read kv head 0
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
    assert list(cap.hidden) == [1]
    full = cap.meta["prompt_token_ids"] + out.token_ids
    ref = reference_qk(asset, model, full[:-1])
    assert close(cap.q[2][0, 0].astype(np.float64), ref[2][0][n - 1, 1])
    assert not close(cap.q[2][0, 0].astype(np.float64), ref[2][0][n - 1, 0])  # the other head
    assert close(cap.k[2][:, 0].astype(np.float64), ref[2][1][:n, 0])


def test_bad_heads_layers_and_sizes_are_refused_before_any_forward(engine):
    n = engine.status().num_layers
    g = engine.backend.attention_geometry
    with count_forwards(engine.backend.model) as forwards:
        with pytest.raises(InvalidParameter) as bad:
            engine.generate_sync(job("x", CaptureSpec(attention=AttentionCaptureSpec(layers=[n]))))
        assert bad.value.param == "capture.attention.layers"
        with pytest.raises(InvalidParameter) as bad:
            engine.generate_sync(job("x", CaptureSpec(attention=AttentionCaptureSpec(layers=[0], heads=[g.num_heads]))))
        assert bad.value.param == "capture.attention.heads"
        with pytest.raises(CaptureTooLarge) as big:
            engine.generate_sync(
                job("y", CaptureSpec(max_bytes=1000, attention=AttentionCaptureSpec(layers=[0, 1], positions="all")))
            )
        rows = big.value.details["rows"]
        # Q: rows x 2 layers x heads x head_dim x 4 + 8; K: the same with kv heads
        want = rows * (2 * g.num_heads * g.head_dim * 4 + 8) + rows * (2 * g.num_kv_heads * g.head_dim * 4 + 8)
        assert big.value.details["estimate_bytes"] == want
    assert forwards[0] == 0
    with pytest.raises(InvalidParameter):
        AttentionCaptureSpec(layers=[0], heads=[])
    with pytest.raises(InvalidParameter):
        AttentionCaptureSpec(layers=[0], q_positions="middle")
