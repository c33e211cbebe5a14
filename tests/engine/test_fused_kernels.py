"""The lean step's C kernels (backends/transformers/cpu_fused.c, MILLM_ENGINE_FUSED_KERNELS).

Oracles: each kernel against the same arithmetic written here with PyTorch ops (the
rotary as rotate_half, grouped-query attention by repeating the key/value heads, softmax),
and the engine decoding through the kernels against the same engine with
``fused_cpu_kernels=False`` (the lean step's PyTorch calls) and against ``model.forward``
(``lean_decode=False``).  A spy on ``_blocks_fused`` shows which path ran, so "equal" cannot
pass by both sides running the same code.
"""

from __future__ import annotations

import pytest
import torch

from gpu_engine.backends.transformers import cpu_fused
from gpu_engine.backends.transformers import lean as lean_module
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import EngineError
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

from .test_hook_points import sae_at

TOKENS = 12

K = cpu_fused.kernels()
pytestmark = pytest.mark.skipif(K is None, reason=f"no C compiler here: {cpu_fused.why_not()}")


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def test_add_rms_is_llama_rms_norm_of_the_sum_and_leaves_its_input_alone():
    torch.manual_seed(0)
    h, delta, w = torch.randn(3, 96), torch.randn(3, 96), torch.randn(96)
    keep = h.clone()
    total, out = torch.empty(3, 96), torch.empty(3, 96)
    K.add_rms(ptr(h), ptr(delta), ptr(w), 1e-6, 3, 96, ptr(total), ptr(out))
    x = keep + delta
    assert torch.equal(h, keep)  # a hook may hold the input
    assert torch.equal(total, x)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    K.add_rms(ptr(h), None, ptr(w), 1e-6, 3, 96, None, ptr(out))  # no residual: the norm of h
    torch.testing.assert_close(out, w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), rtol=1e-6, atol=1e-6)


def test_silu_mul_is_silu_of_the_gate_times_up():
    gu = torch.randn(2, 2 * 40) * 4
    out = torch.empty(2, 40)
    K.silu_mul(ptr(gu), 2, 40, ptr(out))
    torch.testing.assert_close(out, torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:], rtol=1e-6, atol=1e-6)


def test_attention_writes_the_rotated_key_and_attends_like_grouped_query_attention():
    """Three rows at different positions, 6 query heads over 2 key/value heads, the
    second row's first two slots masked (left padding) and holding NaN, which must not
    reach the output; nine positions, so both the four-at-a-time loops and their
    remainder run."""
    torch.manual_seed(1)
    heads, kv, hd, slots, slot, rows = 6, 2, 16, 12, 8, 3
    half = hd // 2
    qkv = torch.randn(rows, (heads + 2 * kv) * hd)
    angles = torch.arange(slots)[:, None].float() * (1.0 / 10000 ** (torch.arange(half).float() / half))
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((angles, angles), -1).sin()
    signed = sin.clone()
    signed[:, :half] = -signed[:, :half]  # the kernel's table: rotate_half's sign folded in
    positions = torch.tensor([7, 5, 3])
    k_buf, v_buf = torch.randn(rows + 1, kv, slots, hd), torch.randn(rows + 1, kv, slots, hd)
    k_buf[1, :, :2] = float("nan")
    v_buf[1, :, :2] = float("nan")
    k_before, v_before = k_buf.clone(), v_buf.clone()
    pad = torch.zeros(rows, slot + 1, dtype=torch.bool)
    pad[1, :2] = True
    scores, out = torch.empty(rows * heads * (slot + 1)), torch.empty(rows, heads * hd)
    K.attention(
        ptr(qkv),
        ptr(cos),
        ptr(signed),
        ptr(positions),
        ptr(k_buf),
        ptr(v_buf),
        slots,
        slot,
        ptr(pad),
        rows,
        heads,
        kv,
        hd,
        0.25,
        ptr(scores),
        ptr(out),
    )

    def rotate(x, p):  # HF's apply_rotary_pos_emb for one position
        return x * cos[p] + torch.cat((-x[..., half:], x[..., :half]), -1) * sin[p]

    q = qkv[:, : heads * hd].view(rows, heads, hd)
    k = qkv[:, heads * hd : (heads + kv) * hd].view(rows, kv, hd)
    v = qkv[:, (heads + kv) * hd :].view(rows, kv, hd)
    for r in range(rows):
        p = int(positions[r])
        want_k, want_v = k_before.clone(), v_before.clone()
        want_k[r, :, slot] = rotate(k[r], p)
        want_v[r, :, slot] = v[r]
        torch.testing.assert_close(k_buf[r], want_k[r], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_buf[r], want_v[r], rtol=0, atol=0, equal_nan=True)
        keys = want_k[r, :, : slot + 1].repeat_interleave(heads // kv, dim=0)  # (heads, end, hd)
        values = want_v[r, :, : slot + 1].repeat_interleave(heads // kv, dim=0)
        values = values.masked_fill(pad[r][None, :, None], 0.0)  # weight 0: never read
        logits = (rotate(q[r], p)[:, None, :] * keys).sum(-1) * 0.25  # (heads, end)
        logits = logits.masked_fill(pad[r], float("-inf"))
        want = (logits.softmax(-1)[:, :, None] * values).sum(1).reshape(-1)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(k_buf[rows], k_before[rows])  # rows past the batch untouched
    assert not out.isnan().any()


def test_the_kernels_share_pytorchs_openmp_runtime():
    """Several rows run on the calling thread's OpenMP team: the library must not bring a
    second runtime (two teams on two cores throttle each other)."""
    import torch  # noqa: F401  (PyTorch's runtime is loaded first, as in the engine)

    assert K.threaded is True
    # other wheels may vendor their own renamed copies (libgomp-<hash>.so.1); the library's
    # own dependency, libgomp.so.1, must be the copy PyTorch loaded
    plain = {path for path in cpu_fused._openmp_runtimes() if path.rsplit("/", 1)[-1] == "libgomp.so.1"}
    assert len(plain) == 1 and "/torch/" in next(iter(plain))


def load(tiny_assets, batching: bool = False, **options) -> Engine:
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4)) if batching else Engine()
    asset = tiny_assets.models["tiny-llama"]
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), device="cpu", options=options))
    return eng


def spy_fused(monkeypatch) -> list[int]:
    """Rows of every step that ran the kernels (the step's own method; the spy counts)."""
    rows: list[int] = []
    real = lean_module.LeanDecode._blocks_fused

    def fused(self, input_ids, *args):
        rows.append(int(input_ids.shape[0]))
        return real(self, input_ids, *args)

    monkeypatch.setattr(lean_module.LeanDecode, "_blocks_fused", fused)
    return rows


def job(rid: str, prompt: str, *, steering=None, monitor=None) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=prompt,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=True),
    )


@pytest.mark.parametrize(
    "weights",
    [{"pack_cpu_weights": False}, {"pack_cpu_weights": True}, {"pack_cpu_weights": False, "quantization": "Q8"}],
    ids=["plain", "onednn-packed", "q8"],
)
def test_decoding_through_the_kernels_equals_the_pytorch_step_and_model_forward(
    tmp_path, tiny_assets, monkeypatch, weights
):
    """Steered and monitored at a block's output, the kernels give the tokens, logprobs,
    activations and steering counts of the lean step's PyTorch calls and of
    model.forward, whatever the products are: plain weights concatenated (one product for
    q/k/v, one for gate/up), a packed group's, or each quantized module's own."""
    sae_dir, _, layer = sae_at(tmp_path, tiny_assets, "resid_post")
    steering = SteeringSpec.from_mapping({("s", layer): {3: 8.0, 17: -5.0}})
    monitor = MonitorSpec([MonitorEntry("s", layer, top_k=5, features=[0, 3, 17], positions="all")])
    rows = spy_fused(monkeypatch)
    out = {}
    for name, options in (("fused", {}), ("torch", {"fused_cpu_kernels": False}), ("forward", {"lean_decode": False})):
        with load(tiny_assets, **weights, **options) as eng:
            caps = eng.backend.capabilities()
            assert caps.fused_cpu_kernels is (name == "fused")
            eng.attach(AttachSpec("s", str(sae_dir), layer))
            before = len(rows)
            out[name] = (
                eng.generate_sync(job("st", "the cat sat on", steering=steering, monitor=monitor)),
                eng.generate_sync(job("plain", "the cat sat on")),
            )
            assert len(rows) - before == (2 * (TOKENS - 1) if name == "fused" else 0)
    fused, plain = out["fused"]
    assert fused.token_ids != plain.token_ids  # the steer did something
    for other in ("torch", "forward"):
        ref, ref_plain = out[other]
        assert fused.token_ids == ref.token_ids and plain.token_ids == ref_plain.token_ids
        assert [lp.logprob for lp in fused.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)
        assert fused.steering_apply_count == ref.steering_apply_count
        got = {(r.position, f.feature_index): f.activation for r in fused.activations for f in r.top_k}
        want = {(r.position, f.feature_index): f.activation for r in ref.activations for f in r.top_k}
        assert got.keys() == want.keys()
        assert [got[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4, rel=1e-4)
    assert sum(c.count for c in fused.steering_apply_count) == TOKENS


def test_a_batch_of_different_lengths_and_steerings_decodes_through_the_kernels_as_each_solo(
    tmp_path, tiny_assets, monkeypatch
):
    """Rows of different prompt lengths (left padding masked) and different steering,
    batched through the kernels, equal each request decoded alone by model.forward."""
    sae_dir, _, layer = sae_at(tmp_path, tiny_assets, "resid_post")
    prompts = ["the cat", "a very long prompt about the cat that sat on the mat", "one two three"]
    steerings = [
        SteeringSpec.from_mapping({("s", layer): {3: 8.0}}),
        None,
        SteeringSpec.from_mapping({("s", layer): {17: -6.0}}),
    ]
    with load(tiny_assets, lean_decode=False) as solo:
        solo.attach(AttachSpec("s", str(sae_dir), layer))
        want = [solo.generate_sync(job(f"s{i}", p, steering=s)) for i, (p, s) in enumerate(zip(prompts, steerings))]
    rows = spy_fused(monkeypatch)
    with load(tiny_assets, batching=True) as eng:
        eng.attach(AttachSpec("s", str(sae_dir), layer))
        streams = [eng.generate(job(f"b{i}", p, steering=s)) for i, (p, s) in enumerate(zip(prompts, steerings))]
        got = [s.result(timeout_s=120) for s in streams]
    assert max(rows) == 3  # the three rows decoded in one step through the kernels
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
        assert g.steering_apply_count == w.steering_apply_count


def test_the_setting_turns_them_off_and_true_refuses_a_machine_that_cannot_build_them(tiny_assets, monkeypatch):
    with load(tiny_assets, fused_cpu_kernels=False) as eng:
        caps = eng.backend.capabilities()
        assert caps.fused_cpu_kernels is False and caps.fused_cpu_kernels_reason == "off (fused_cpu_kernels)"
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails every build
    cpu_fused.kernels.cache_clear()
    monkeypatch.setattr(cpu_fused, "_why_not", None)
    try:
        with load(tiny_assets) as eng:  # auto: decodes with the PyTorch calls and says why
            caps = eng.backend.capabilities()
            assert caps.fused_cpu_kernels is False
            assert "could not be built" in caps.fused_cpu_kernels_reason
            assert len(eng.generate_sync(job("g", "the cat")).token_ids) == TOKENS
        with Engine() as eng, pytest.raises(EngineError) as err:
            eng.load_model(
                LoadModelJob(
                    "tiny-llama",
                    str(tiny_assets.models["tiny-llama"].path),
                    device="cpu",
                    options={"fused_cpu_kernels": True},
                )
            )
        assert err.value.code == "invalid_parameter" and "could not be built" in str(err.value)
        assert eng.status().state == "empty"  # nothing half-loaded
    finally:
        cpu_fused.kernels.cache_clear()
