"""Capture on the vLLM backend (issue 15) against the transformers backend on the same
weights and against a Q/K reference computed here (float32, greedy).

Hidden states: the vLLM capture equals the transformers backend's capture of the same
request (itself checked against an independent forward in tests/engine/test_capture.py)
within ``VLLM_ACT_ATOL``, the bound of the vLLM-vs-transformers monitoring tests (vLLM's
CPU kernels differ in the last bits, which grow through the layers).  Q/K: equal to
``reference_qk`` (tests/engine/test_capture_qk.py: each attention module's input through
its own weights and the model's ``apply_rotary_pos_emb``) within the same bound.  In a
mixed vLLM batch every request's capture equals its solo capture within 2e-5 (vLLM
against itself, as the mixed-batch monitoring test).  Positive controls: zeros, the
neighbouring layer and un-rotated keys fail the checks.

Tensor parallelism: tests/vllm/test_vllm_tp2.py (two vLLM workers, where
``MILLM_VLLM_TP2=1`` is set), and tests/engine/test_capture_shards.py tests the shard merge.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.errors import CaptureTooLarge, InvalidParameter
from gpu_engine.api.protocol import (
    AttentionCaptureSpec,
    CaptureSpec,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
    TokenEvent,
)
from tests.engine.test_capture_qk import reference_qk
from tests.engine.tolerances import POSITIVE_CONTROL_MIN

from .conftest import SAES
from .test_vllm_engine import PROMPTS, VLLM_ACT_ATOL

L1 = (SAES[0], 1)
BATCH_ATOL = 2e-5  # vLLM against itself in a batch (test_vllm_engine's mixed-batch bound)


def job(
    rid: str, capture: CaptureSpec | None = None, prompt: str = PROMPTS[0], steering=None, n: int = 8, monitor=None
) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=prompt,
        capture=capture,
        steering=SteeringSpec.from_mapping(steering) if steering else None,
        monitor=MonitorSpec(entries=monitor) if monitor else None,
        sampling=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
    )


def close(a, b, atol: float = VLLM_ACT_ATOL) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and np.allclose(a, b, atol=atol, rtol=0)


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def armed(eng) -> list[dict]:
    return eng.backend.engine.collective_rpc("millm_armed")


@pytest.fixture(scope="module")
def hf_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32, local_files_only=True).eval()
    return asset, model


def test_capabilities_report_capture_eager_and_compiled(vllm_engine):
    from types import SimpleNamespace

    from gpu_engine.backends.vllm.backend import VllmBackend

    caps = vllm_engine.status().batching["capabilities"]
    assert caps["hidden_state_capture"] is True and caps["attention_capture"] is True
    # compiled, both are captured through the layers' and Attention modules' taps
    # (test_vllm_compiled.py runs them)
    graphs = VllmBackend.capabilities(
        SimpleNamespace(
            enforce_eager=False,
            num_layers=4,
            attention_geometry=vllm_engine.backend.attention_geometry,
            _attention_layers={0, 1, 2, 3},
            tool_call_format=None,
            worker_device="cpu",
        )
    )
    assert graphs.hidden_state_capture is True and graphs.attention_capture is True


def test_capture_changes_no_token_and_equals_transformers_and_the_qk_reference(vllm_engine, hf_engine, hf_model):
    assert_capture_equals_transformers_and_the_qk_reference(vllm_engine, hf_engine, hf_model)


def assert_capture_equals_transformers_and_the_qk_reference(vllm_engine, hf_engine, hf_model):
    """Every layer's hidden states and Q/K, against the transformers backend and the Q/K
    reference (eager here; compiled in test_vllm_compiled.py)."""
    asset, model = hf_model
    layers = list(range(asset.num_layers))
    spec = CaptureSpec(layers=layers, positions="all", attention=AttentionCaptureSpec(layers=layers, positions="all"))
    plain = vllm_engine.generate_sync(job("plain"))
    got = vllm_engine.generate_sync(job("cap", spec))
    want = hf_engine.generate_sync(job("cap", spec))
    assert got.token_ids == plain.token_ids == want.token_ids
    cap, ref_cap = load_capture(got.capture.data), load_capture(want.capture.data)
    assert cap.meta["backend"] == "vllm" and ref_cap.meta["backend"] == "transformers"
    for key in (
        "layers",
        "positions",
        "row_positions",
        "token_ids",
        "prompt_token_ids",
        "completion_token_ids",
        "dtype",
        "hidden_size",
        "rows",
        "request_id",
        "model",
    ):
        assert cap.meta[key] == ref_cap.meta[key], key
    for key in (
        "layers",
        "heads",
        "kv_heads",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "q_row_positions",
        "k_row_positions",
    ):
        assert cap.attention[key] == ref_cap.attention[key], key
    assert "shards" not in cap.attention  # one rank: plain q.<L>/k.<L>
    assert (
        cap.positions.tolist()
        == ref_cap.positions.tolist()
        == list(range(len(cap.meta["prompt_token_ids"]) + len(got.token_ids) - 1))
    )
    for layer in layers:
        assert close(cap.hidden[layer], ref_cap.hidden[layer]), (layer, worst(cap.hidden[layer], ref_cap.hidden[layer]))
        # positive controls: zeros, the neighbouring layer
        assert not close(np.zeros_like(cap.hidden[layer]), ref_cap.hidden[layer])
        assert not close(cap.hidden[layer], ref_cap.hidden[(layer + 1) % len(layers)])
    full = cap.meta["prompt_token_ids"] + got.token_ids
    ref = reference_qk(asset, model, full[:-1])
    for layer in layers:
        q, k = cap.q[layer], cap.k[layer]
        assert close(q, ref[layer][0]), (layer, worst(q, ref[layer][0]))
        assert close(k, ref[layer][1]), (layer, worst(k, ref[layer][1]))
        assert not close(k, ref[(layer + 1) % len(layers)][1])
        scale = float(model.model.layers[layer].self_attn.scaling)
        assert cap.attention["scaling"][str(layer)] == pytest.approx(scale)
    unrotated = reference_qk(asset, model, full[:-1], rotate=False)
    assert not close(cap.k[1][1:], unrotated[1][1][1:])  # row 0 has angle 0
    assert armed(vllm_engine) == [{"hidden": [], "qk": []}]  # no hook outlives its request


@pytest.mark.parametrize("positions", ["last", "prompt", "completion", "last_prompt"])
def test_positions_modes_and_heads_equal_transformers(vllm_engine, hf_engine, positions):
    # the Attention Tracker's shape: one head's Q at the prompt's last token, K over the prompt
    spec = CaptureSpec(
        layers=[1, 3],
        positions=positions,
        attention=AttentionCaptureSpec(layers=[2], heads=[1], positions="prompt", q_positions="last_prompt"),
    )
    got = load_capture(vllm_engine.generate_sync(job("m", spec, PROMPTS[2], n=5)).capture.data)
    want = load_capture(hf_engine.generate_sync(job("m", spec, PROMPTS[2], n=5)).capture.data)
    n_prompt = len(got.meta["prompt_token_ids"])
    expected = {
        "last": [n_prompt + 3],
        "prompt": list(range(n_prompt)),
        "completion": list(range(n_prompt - 1, n_prompt + 4)),
        "last_prompt": [n_prompt - 1],
    }[positions]
    assert got.positions.tolist() == want.positions.tolist() == expected
    assert got.token_ids.tolist() == want.token_ids.tolist()
    for layer in (1, 3):
        assert close(got.hidden[layer], want.hidden[layer]), (layer, worst(got.hidden[layer], want.hidden[layer]))
    assert got.attention["heads"] == [1] and got.attention["kv_heads"] == [0]
    assert got.q_positions.tolist() == [n_prompt - 1] and got.k_positions.tolist() == list(range(n_prompt))
    assert got.q[2].shape == want.q[2].shape == (1, 1, 32)
    assert close(got.q[2], want.q[2]) and close(got.k[2], want.k[2])


def test_a_steered_request_captures_its_steered_stream(vllm_engine, hf_engine):
    assert_steered_capture_equals_transformers(vllm_engine, hf_engine)


def assert_steered_capture_equals_transformers(vllm_engine, hf_engine):
    """A steered capture against the transformers backend's, and its steer where it is
    (eager here; compiled in test_vllm_compiled.py)."""
    steering = {L1: {3: 8.0, 17: -5.0}}
    spec = CaptureSpec(layers=[0, 1, 2], positions="all")
    unsteered = load_capture(vllm_engine.generate_sync(job("u", spec)).capture.data)
    out = vllm_engine.generate_sync(job("s", spec, steering=steering))
    got = load_capture(out.capture.data)
    want = load_capture(hf_engine.generate_sync(job("s", spec, steering=steering)).capture.data)
    assert got.meta["steering_hash"] == SteeringSpec.from_mapping(steering).canonical_hash()
    assert got.positions.tolist() == want.positions.tolist()
    for layer in (0, 1, 2):
        assert close(got.hidden[layer], want.hidden[layer]), (layer, worst(got.hidden[layer], want.hidden[layer]))
    # the steer is at layer 1's output: over the prompt (the same tokens fed), layer 0 is
    # the unsteered stream and layer 1 is not
    n = len(got.meta["prompt_token_ids"])
    assert close(got.hidden[0][:n], unsteered.hidden[0][:n], atol=BATCH_ATOL)
    assert worst(got.hidden[1][:n], unsteered.hidden[1][:n]) >= POSITIVE_CONTROL_MIN


def test_mixed_batch_each_capture_equals_its_solo_capture(vllm_engine):
    """Capturing, steered, monitored and plain requests; staggered joins; one cancelled."""
    qk = AttentionCaptureSpec(layers=[0, 3], heads=[0], positions="all", q_positions="completion")
    jobs = {
        "all": job("all", CaptureSpec(layers=[0, 2, 3], positions="all", attention=qk), PROMPTS[0], n=10),
        "steered": job(
            "steered", CaptureSpec(layers=[1, 2], positions="completion"), PROMPTS[0], steering={L1: {3: 8.0}}, n=9
        ),
        "plain": job("plain", None, PROMPTS[1], n=12),
        "last": job(
            "last",
            CaptureSpec(
                layers=[3],
                positions="last",
                attention=AttentionCaptureSpec(layers=[1], positions="prompt", q_positions="last_prompt"),
            ),
            PROMPTS[2],
            n=7,
            monitor=[MonitorEntry(SAES[1], 2, top_k=3, positions="all")],
        ),
        "prompt": job("prompt", CaptureSpec(layers=[0, 1], positions="prompt"), PROMPTS[1], n=6),
    }
    solo = {name: vllm_engine.generate_sync(j, timeout_s=120) for name, j in jobs.items()}
    victim_job = job("victim", CaptureSpec(layers=[2], positions="all"), PROMPTS[1], n=40)
    victim_solo = vllm_engine.generate_sync(victim_job, timeout_s=120)

    first = {name: vllm_engine.generate(jobs[name]) for name in ("all", "plain", "steered")}
    victim = vllm_engine.generate(victim_job)
    # the others join once the first ones are decoding (an events() iterator dropped
    # unfinished cancels its stream: keep it)
    head = first["plain"].events(60)
    next(e for e in head if isinstance(e, TokenEvent))
    later = {name: vllm_engine.generate(jobs[name]) for name in ("last", "prompt")}
    next(e for e in victim.events(60) if isinstance(e, TokenEvent))
    victim.cancel()
    together = {"plain": first["plain"].result(120)}
    together.update({name: s.result(120) for name, s in {**first, **later}.items() if name != "plain"})
    cancelled = victim.result(60)
    for name, res in together.items():
        assert res.token_ids == solo[name].token_ids, name
        if res.capture is None:
            assert solo[name].capture is None
            continue
        a, b = load_capture(res.capture.data), load_capture(solo[name].capture.data)
        assert a.positions.tolist() == b.positions.tolist() and a.token_ids.tolist() == b.token_ids.tolist(), name
        for layer in a.meta["layers"]:
            assert close(a.hidden[layer], b.hidden[layer], BATCH_ATOL), (name, layer)
        for layer in (a.attention or {}).get("layers", []):
            assert a.q_positions.tolist() == b.q_positions.tolist() and a.k_positions.tolist() == b.k_positions.tolist()
            assert close(a.q[layer], b.q[layer], BATCH_ATOL) and close(a.k[layer], b.k[layer], BATCH_ATOL), (
                name,
                layer,
            )
    # the cancelled request keeps the rows of the tokens it made: a prefix of its solo rows
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 40
    c, s = load_capture(cancelled.capture.data), load_capture(victim_solo.capture.data)
    n = len(c.positions)
    assert n == len(c.meta["prompt_token_ids"]) + len(cancelled.token_ids) - 1
    assert c.positions.tolist() == s.positions.tolist()[:n]
    assert close(c.hidden[2], s.hidden[2][:n], BATCH_ATOL)
    assert armed(vllm_engine) == [{"hidden": [], "qk": []}]


def test_bad_captures_are_refused_before_vllm_runs_them(vllm_engine):
    batch = vllm_engine._scheduler.backend
    n = vllm_engine.status().num_layers
    before = batch.steps
    with pytest.raises(InvalidParameter) as bad:
        vllm_engine.generate_sync(job("x", CaptureSpec(layers=[n])))
    assert bad.value.param == "capture.layers"
    with pytest.raises(InvalidParameter) as bad:
        vllm_engine.generate_sync(job("x", CaptureSpec(attention=AttentionCaptureSpec(layers=[0], heads=[2]))))
    assert bad.value.param == "capture.attention.heads"
    with pytest.raises(CaptureTooLarge) as big:
        vllm_engine.generate_sync(job("x", CaptureSpec(layers=[0, 1, 2, 3], positions="all", max_bytes=1000)))
    rows = big.value.details["rows"]
    assert big.value.details["estimate_bytes"] == rows * (4 * 64 * 4 + 16)
    assert batch.steps == before  # nothing reached vLLM
