"""The serial path's lean one-token step (backends/transformers/lean.py) against
``model.forward``, and the load-time kernel choice (MILLM_ENGINE_PACK_WEIGHTS=auto).

The oracles are independent of the step: an unmodified transformers model decoding with
its own cache, and the same engine code with ``lean_decode=False`` (every step through
``model.forward``).  A spy on ``LeanDecode.step`` shows which path each request took, so
a test of "equal results" cannot pass by both sides running ``model.forward``.
"""

from __future__ import annotations

import pytest
import torch

from gpu_engine.backends.transformers import runner as runner_module
from gpu_engine.backends.transformers.cpu_kernels import PackedLinear
from gpu_engine.runtime.engine import Engine
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

PROMPT = "the cat sat on the mat and"
TOKENS = 16


def job(rid: str, *, steering=None, monitor=None, logprobs: bool = False) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs),
    )


def load(model: str, tiny_assets, **options) -> Engine:
    eng = Engine()
    eng.load_model(LoadModelJob(model, str(tiny_assets.models[model].path), device="cpu", options=options))
    return eng


def spy_steps(eng: Engine, monkeypatch) -> list[int]:
    """Positions the lean step ran at (it is the engine's; the spy only counts)."""
    lean = eng.backend.lean
    calls: list[int] = []
    real = lean.step

    def step(input_ids, position):
        calls.append(position)
        return real(input_ids, position)

    monkeypatch.setattr(lean, "step", step)
    return calls


def test_lean_decoding_equals_an_independent_transformers_decode(tiny_assets, monkeypatch):
    """Greedy tokens and their logprobs equal a plain transformers model decoding with
    its own cache; every step after the prefill ran the lean step, at its position."""
    from transformers import AutoModelForCausalLM, DynamicCache

    asset = tiny_assets.models["tiny-llama"]
    plain = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32).eval()
    with load("tiny-llama", tiny_assets, pack_cpu_weights=False) as eng:
        caps = eng.backend.capabilities()
        assert caps.lean_decode is True and caps.lean_decode_reason is None
        # plain weights: q/k/v and gate/up are one product each, the modules' weights views
        # of it (no second copy)
        attn = eng.backend.model.model.layers[1].self_attn
        qkv, gate_up = eng.backend.lean.fused[1]
        assert qkv is not None and gate_up is not None
        assert {p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.v_proj.weight)} == {
            qkv[0].keywords["weight"].untyped_storage().data_ptr()
        }
        calls = spy_steps(eng, monkeypatch)
        out = eng.generate_sync(job("g", logprobs=True))
        prompt = eng.backend.encode_text(PROMPT)
    want_tokens, want_lp = [], []
    with torch.inference_mode():
        past, ids = DynamicCache(), torch.tensor([prompt])
        for _ in range(TOKENS):
            logits = plain(input_ids=ids, past_key_values=past, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            want_tokens.append(token)
            want_lp.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.tensor([[token]])
    assert out.token_ids == want_tokens
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(want_lp, abs=1e-4)
    n = len(prompt)
    assert calls == list(range(n, n + TOKENS - 1))  # the prefill was model.forward


@pytest.mark.parametrize("case", ["resid_post", "resid_pre_0", "attn_out", "mlp_out", "mlp_transcoder"])
def test_steering_and_monitoring_equal_model_forward_at_every_hook_point(tmp_path, tiny_assets, monkeypatch, case):
    """Steered and monitored, the lean step gives model.forward's tokens, activations and
    steering counts; the steer changes the tokens (positive control)."""
    sae_dir, _, layer = sae_at(tmp_path, tiny_assets, case)
    steering = SteeringSpec.from_mapping({("s", layer): {3: 8.0, 17: -5.0}})
    monitor = MonitorSpec([MonitorEntry("s", layer, top_k=5, features=[0, 3, 17], positions="all")])
    results = {}
    for lean in (True, False):
        with load("tiny-llama", tiny_assets, lean_decode=lean) as eng:
            eng.attach(AttachSpec("s", str(sae_dir), layer))
            calls = spy_steps(eng, monkeypatch) if lean else []
            results[lean] = (
                eng.generate_sync(job("st", steering=steering, monitor=monitor)),
                eng.generate_sync(job("plain")),
            )
            assert len(calls) == (2 * (TOKENS - 1) if lean else 0)  # both requests
    (lean_out, lean_plain), (ref_out, ref_plain) = results[True], results[False]
    assert lean_out.token_ids == ref_out.token_ids
    assert lean_plain.token_ids == ref_plain.token_ids
    assert lean_out.token_ids != lean_plain.token_ids  # the steer did something
    assert lean_out.steering_apply_count == ref_out.steering_apply_count
    assert sum(c.count for c in lean_out.steering_apply_count) == TOKENS  # every forward steered
    got = {(r.position, f.feature_index): f.activation for r in lean_out.activations for f in r.top_k}
    want = {(r.position, f.feature_index): f.activation for r in ref_out.activations for f in r.top_k}
    assert got.keys() == want.keys() and len(got) >= 5 * (TOKENS + 1)
    assert [got[k] for k in want] == pytest.approx(list(want.values()), abs=1e-5, rel=1e-5)
    sel = [(r.position, [(f.feature_index, f.activation) for f in r.features]) for r in lean_out.activations]
    ref_sel = [(r.position, [(f.feature_index, f.activation) for f in r.features]) for r in ref_out.activations]
    assert [p for p, _ in sel] == [p for p, _ in ref_sel]
    for (_, a), (_, b) in zip(sel, ref_sel):
        assert [i for i, _ in a] == [i for i, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-5, rel=1e-5)


def test_a_hook_the_step_does_not_run_sends_the_request_through_model_forward(tiny_assets, monkeypatch):
    """A forward hook on a projection (not a module the step runs hooks of) sees every
    forward pass, because that request takes model.forward; removed, the step is back."""
    with load("tiny-llama", tiny_assets) as eng:
        calls = spy_steps(eng, monkeypatch)
        seen: list[int] = []
        proj = eng.backend.model.model.layers[1].self_attn.q_proj
        handle = proj.register_forward_hook(lambda m, a, o: seen.append(o.shape[-2]))
        hooked = eng.generate_sync(job("hooked"))
        assert len(seen) == TOKENS and calls == []
        handle.remove()
        again = eng.generate_sync(job("again"))
        assert len(seen) == TOKENS and len(calls) == TOKENS - 1
        assert again.token_ids == hooked.token_ids


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gpt2"])
def test_other_architectures_keep_model_forward_and_say_why(tiny_assets, model):
    with load(model, tiny_assets) as eng:
        caps = eng.backend.capabilities()
        assert caps.lean_decode is False and "not a Llama-family model" in caps.lean_decode_reason
        assert len(eng.generate_sync(job("g")).token_ids) == TOKENS
    with load("tiny-llama", tiny_assets, lean_decode=False) as eng:
        assert eng.backend.capabilities().lean_decode_reason == "turned off (lean_decode)"
    with load("tiny-llama", tiny_assets, kv_cache_mode="static") as eng:
        assert eng.backend.capabilities().lean_decode is False


@pytest.mark.parametrize("packed_faster, kernels", [(True, "onednn_packed"), (False, "default")])
def test_auto_packing_follows_the_one_row_probe_and_a_batching_engine_packs(
    tiny_assets, monkeypatch, packed_faster, kernels
):
    """MILLM_ENGINE_PACK_WEIGHTS=auto (no option): a serial engine keeps what the probe
    timed faster; a batching engine packs whatever the probe said; both decode alike."""
    probe = {"packed_ms": 1.0, "default_ms": 2.0} if packed_faster else {"packed_ms": 2.0, "default_ms": 1.0}
    monkeypatch.setattr(runner_module, "one_row_probe", lambda model: dict(probe))
    asset = tiny_assets.models["tiny-llama"]
    load_job = LoadModelJob("m", str(asset.path), device="cpu")
    with Engine() as serial, Engine(batching=BatchingOptions(enabled=True, max_batch_size=4)) as batching:
        serial.load_model(load_job)
        batching.load_model(load_job)
        assert serial.status().kernels == kernels
        assert serial.backend.capabilities().kernel_probe == probe
        packed = any(isinstance(m, PackedLinear) for m in serial.backend.model.modules())
        assert packed is packed_faster
        assert batching.status().kernels == "onednn_packed"
        # packed: q/k/v and gate/up each one packed group, whose product the step calls
        assert all(
            qkv is not None and gate_up is not None and qkv[0].__self__ is not gate_up[0].__self__
            for qkv, gate_up in batching.backend.lean.fused
        )
        assert not any(type(m) is torch.nn.Linear for m in batching.backend.model.modules())
        assert serial.generate_sync(job("s")).token_ids == batching.generate_sync(job("b")).token_ids
        packed_later = batching.status().weights
    with Engine() as packed_at_load:
        # packed later or at load, the status reports the same weights (a tied head's
        # packed copy included)
        packed_at_load.load_model(LoadModelJob("m", str(asset.path), device="cpu", options={"pack_cpu_weights": True}))
        assert packed_later == packed_at_load.status().weights


def test_the_real_probe_times_both_layouts_within_its_budget():
    from gpu_engine.backends.transformers.cpu_kernels import one_row_probe

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 1024, bias=False) for _ in range(4)])
    got = one_row_probe(model, budget=2 * 256 * 1024 * 4, rounds=3)
    assert got["bytes"] == 2 * 256 * 1024 * 4  # two of the four weights, then the budget
    assert got["packed_ms"] > 0 and got["default_ms"] > 0
