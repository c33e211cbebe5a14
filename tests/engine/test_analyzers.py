"""Analyzers (issue 15) against numbers worked out by hand on crafted tensors, the
registry and its refusals, and end to end on the tiny model's real Q/K capture."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gpu_engine.analysis import (
    AnalysisContext,
    AnalyzerRegistry,
    CaptureNeed,
    capture_spec_for,
    check_capture,
    default_registry,
    load_extra,
)
from gpu_engine.analysis.attention import core_document_scores, query_attention
from gpu_engine.api.artifacts import CaptureData, load_capture
from gpu_engine.api.errors import (
    AnalyzerCaptureMissing,
    InvalidParameter,
    InvalidProbeFile,
    UnknownAnalyzer,
)
from gpu_engine.api.protocol import AttentionCaptureSpec, CaptureSpec

from .test_capture import PROMPT, engines, reference  # noqa: F401  (fixtures)
from .test_capture_qk import job, reference_qk

LN2, LN3 = math.log(2), math.log(3)


def qk_capture(
    q_rows, k_rows, *, heads, kv_heads, num_heads, num_kv_heads, prompt_len, q_pos, k_pos=None, layer=0, scale=1.0
):
    """A capture holding one layer's Q (rows, heads, d) and K (rows, kv_heads, d)."""
    q, k = np.asarray(q_rows, dtype=np.float32), np.asarray(k_rows, dtype=np.float32)
    meta = {
        "prompt_token_ids": list(range(prompt_len)),
        "layers": [],
        "positions": "last",
        "attention": {
            "layers": [layer],
            "heads": heads,
            "kv_heads": kv_heads,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": q.shape[-1],
            "positions": "prompt",
            "q_positions": "prompt" if len(q_pos) > 1 else "last_prompt",
            "scaling": {str(layer): scale},
        },
    }
    return CaptureData(
        meta=meta,
        q={layer: q},
        k={layer: k},
        q_positions=np.asarray(q_pos),
        k_positions=np.asarray(k_pos if k_pos is not None else range(prompt_len)),
    )


def run(name, capture, params, ctx=None):
    reg = default_registry()
    a = reg.get(name)
    ctx = ctx or AnalysisContext()
    p = a.prepare(params, ctx)
    return a.run(capture, p, ctx)


def test_attention_tracker_by_hand():
    # GQA 4 query heads on 2 KV heads; captured query heads 1 (-> kv 0) and 2 (-> kv 1)
    # kv 0 keys give logits [0, ln2, ln3, 0]: attention [1, 2, 3, 1] / 7;
    # kv 1 keys are zero: attention 1/4 each
    k = [[[0.0], [0.0]], [[LN2], [0.0]], [[LN3], [0.0]], [[0.0], [0.0]]]
    cap = qk_capture(
        [[[1.0], [1.0]]], k, heads=[1, 2], kv_heads=[0, 1], num_heads=4, num_kv_heads=2, prompt_len=4, q_pos=[3]
    )
    out = run("attention_tracker", cap, {"layer_heads": {"0": [1, 2]}, "instruction": [0, 2], "data": [-2, 4]})
    # head 1: instruction 3/7, data 4/7 -> 3/7; head 2: 0.5 / 1.0 -> 0.5
    assert out["heads"] == [
        {"layer": 0, "head": 1, "score": pytest.approx(3 / 7)},
        {"layer": 0, "head": 2, "score": pytest.approx(0.5)},
    ]
    assert out["score"] == pytest.approx((3 / 7 + 0.5) / 2)
    assert out["data"] == [2, 4]
    # positive control: swapping the spans changes the score
    swapped = run("attention_tracker", cap, {"layer_heads": {"0": [1]}, "instruction": [2, 4], "data": [0, 2]})
    assert swapped["score"] == pytest.approx(4 / 7)


def test_attnlink_by_hand():
    k = [[[0.0]], [[LN2]], [[LN3]], [[0.0]]]
    cap = qk_capture([[[1.0]]], k, heads=[0], kv_heads=[0], num_heads=1, num_kv_heads=1, prompt_len=4, q_pos=[3])
    out = run(
        "attnlink",
        cap,
        {"layer_heads": {"0": [0]}, "candidates": ["a", "b", "c"], "candidate_spans": [[0, 2], [2, 3], [3, 4]]},
    )
    # attention [1, 2, 3, 1] / 7: span means 1.5/7, 3/7, 1/7
    assert out["scores"] == pytest.approx([3 / 14, 6 / 14, 2 / 14])
    assert out["probabilities"] == pytest.approx([3 / 11, 6 / 11, 2 / 11], abs=1e-7)
    assert out["ranking"] == [1, 0, 2] and out["selected"] == [1, 0]  # 6/11 < 0.8 <= 9/11


def test_core_math_by_hand():
    # queries at positions 1 and 2 with zero logits: causal uniform [1/2, 1/2, 0], [1/3]*3
    got = query_attention(np.zeros((2, 1)), np.zeros((3, 1)), np.array([1, 2]), 1.0)
    assert got == pytest.approx([5 / 12, 5 / 12, 1 / 6])
    # calibrated: nine tokens at +1 and one at -10; mean -0.1, std 3.4785: -10 is dropped
    tok = np.array([2.0] * 9 + [0.0])
    na = np.array([1.0] * 9 + [10.0])
    assert core_document_scores(tok, na, [(0, 10)]) == pytest.approx([9.0])
    # [1, 1]: threshold 1 - 0 = 1 and the test is strict (mia's ``>``): nothing kept;
    # [1, -10]: mean -4.5, std 7.78: both kept
    assert core_document_scores(tok, na, [(0, 2), (8, 10)]) == pytest.approx([0.0, -9.0])


def test_core_reranker_with_an_na_run():
    # 5 prompt tokens; documents [0, 2) and [2, 4); query token at position 4
    k = np.array([[[0.0]], [[LN2]], [[LN3]], [[0.0]], [[0.0]]])
    q = np.zeros((5, 1, 1))
    q[4, 0, 0] = 1.0
    main = qk_capture(q, k, heads=[0], kv_heads=[0], num_heads=1, num_kv_heads=1, prompt_len=5, q_pos=[0, 1, 2, 3, 4])
    na_q = np.zeros((5, 1, 1))  # N/A query: uniform attention 1/5
    na = qk_capture(na_q, k, heads=[0], kv_heads=[0], num_heads=1, num_kv_heads=1, prompt_len=5, q_pos=[0, 1, 2, 3, 4])
    ctx = AnalysisContext(load_capture=lambda cid: {"na": na}[cid])
    out = run(
        "core_reranker",
        main,
        {
            "layer_heads": {"0": [0]},
            "documents": [[0, 2], [2, 4]],
            "query": [4, 5],
            "na_capture": "na",
            "na_query": [4, 5],
        },
        ctx,
    )
    # main attention [1, 2, 3, 1, 1] / 8; N/A 1/5 each; differences per document:
    # doc 0: 1/8 - 1/5, 2/8 - 1/5; doc 1: 3/8 - 1/5, 1/8 - 1/5 (two tokens: nothing dropped)
    d0 = (1 / 8 - 1 / 5) + (2 / 8 - 1 / 5)
    d1 = (3 / 8 - 1 / 5) + (1 / 8 - 1 / 5)
    assert out["scores"] == pytest.approx([d0, d1]) and out["ranking"] == [1, 0]


def write_hnode(path, **over):
    probe = dict(
        best_layer=np.array(2),
        weights=np.array([2.0, 5.0]),
        bias=np.array(-1.0),
        scaler_mean=np.array([1.0, 1.0]),
        scaler_scale=np.array([2.0, 0.0]),
        h_node_indices=np.array([0, 1]),
        h_node_baselines=np.array([2.5, 2.0]),
    )
    probe.update(over)
    np.savez(path, **{k: v for k, v in probe.items() if v is not None})


def test_hnode_probe_by_hand(tmp_path):
    write_hnode(tmp_path / "h.npz")
    cap = CaptureData(
        meta={"prompt_token_ids": [0], "layers": [2], "positions": "last"},
        hidden={2: np.array([[3.0, 1.0]], dtype=np.float32)},
        positions=np.array([5]),
    )
    out = run("hnode_hallucination", cap, {"probe": "h.npz"}, AnalysisContext(probe_dir=tmp_path))
    # standardised [(3-1)/2, (1-1)/1] = [1, 0] (zero scale counts as 1): margin 2 - 1 = 1
    assert out["margin"] == pytest.approx(1.0) and out["probability"] == pytest.approx(1 / (1 + math.exp(-1)))
    assert out["h_node_excess"] == pytest.approx(0.25)  # max(0, 3-2.5), max(0, 1-2) -> mean 0.25
    assert out["verdict"] == "hallucinated" and out["best_layer"] == 2 and out["n_h_nodes"] == 2
    assert (
        run("hnode_hallucination", cap, {"probe": "h.npz", "threshold": 0.9}, AnalysisContext(probe_dir=tmp_path))[
            "verdict"
        ]
        == "grounded"
    )


def test_malformed_probes_are_refused(tmp_path):
    ctx = AnalysisContext(probe_dir=tmp_path)
    reg = default_registry()
    write_hnode(tmp_path / "short.npz", scaler_mean=np.array([1.0]))
    write_hnode(tmp_path / "nolayer.npz", best_layer=None)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    (tmp_path / "pickled.npz").write_bytes((tmp_path / "obj.npy").read_bytes())
    np.savez(tmp_path / "objects.npz", weights=np.array([{"x": 1}], dtype=object))
    (tmp_path / "notzip.npz").write_bytes(b"PK\x03\x04 no zip archive behind the magic")
    for name in ("short.npz", "nolayer.npz", "pickled.npz", "objects.npz", "missing.npz", "h.json", "notzip.npz"):
        with pytest.raises(InvalidProbeFile):
            reg.get("hnode_hallucination").prepare({"probe": name}, ctx)
    with pytest.raises(InvalidParameter):  # a path, not a name in the probe directory
        reg.get("hnode_hallucination").prepare({"probe": "../h.npz"}, ctx)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidProbeFile):
        reg.get("science_hallucination").prepare({"probe": "bad.json"}, ctx)


def test_science_probe_by_hand(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"layer": 1, "weights": [0.5, -0.25], "bias": 0.0}))
    # prompt of 3 tokens: completion rows are positions 2, 3, 4; position 1 is a prompt row
    cap = CaptureData(
        meta={"prompt_token_ids": [0, 1, 2], "layers": [1], "positions": "all"},
        hidden={1: np.array([[9.0, 9.0], [1.0, 0.0], [3.0, 2.0], [2.0, 4.0]], dtype=np.float32)},
        positions=np.array([1, 2, 3, 4]),
    )
    out = run("science_hallucination", cap, {"probe": "s.json"}, AnalysisContext(probe_dir=tmp_path))
    # mean completion row [2, 2]: margin 1 - 0.5 = 0.5
    assert out["margin"] == pytest.approx(0.5) and out["probability"] == pytest.approx(1 / (1 + math.exp(-0.5)))
    assert out["verdict"] == "hallucinated"
    np.savez(tmp_path / "s.npz", layer=np.array(1), weights=np.array([0.5, -0.25]), bias=np.array(0.0))
    assert run("science_hallucination", cap, {"probe": "s.npz"}, AnalysisContext(probe_dir=tmp_path))[
        "margin"
    ] == pytest.approx(0.5)


def test_hidden_state_reductions_by_hand():
    cap = CaptureData(
        meta={"prompt_token_ids": [0], "layers": [0], "positions": "all"},
        hidden={0: np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)},
        positions=np.array([0, 1]),
    )
    assert run("hidden_states", cap, {"layers": [0], "reduce": "norm"})["layers"]["0"] == pytest.approx(5.0)
    assert run("hidden_states", cap, {"layers": [0], "reduce": "mean"})["layers"]["0"] == [1.5, 2.0]
    assert run("hidden_states", cap, {"layers": [0], "reduce": "last"})["layers"]["0"] == [0.0, 0.0]
    assert run("hidden_states", cap, {"layers": [0]})["layers"]["0"] == [[3.0, 4.0], [0.0, 0.0]]


def test_hidden_state_reductions_read_their_own_rows_of_a_wider_capture():
    # prompt of 2 tokens, 2 generated: rows at positions 0, 1 (prompt), 2; a capture at
    # "all" (a request's own, united with the analyzer's) holds every mode's rows
    cap = CaptureData(
        meta={"prompt_token_ids": [0, 1], "layers": [0], "positions": "all"},
        hidden={0: np.array([[1.0, 0.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)},
        positions=np.array([0, 1, 2]),
    )

    def reduce(how, positions):
        return run("hidden_states", cap, {"layers": [0], "reduce": how, "positions": positions})["layers"]["0"]

    assert reduce("mean", "prompt") == [2.0, 2.0]
    assert reduce("mean", "completion") == [4.0, 5.0]  # rows P-1 and P
    assert reduce("none", "last_prompt") == [[3.0, 4.0]]
    assert reduce("last", "last") == [5.0, 6.0]
    assert reduce("norm", "all") == pytest.approx(math.sqrt(1 + 9 + 16 + 25 + 36))


def test_registry_names_refusals_and_extension():
    reg = default_registry()
    with pytest.raises(UnknownAnalyzer) as unknown:
        reg.get("nope")
    assert "attention_tracker" in unknown.value.message and unknown.value.details["known"] == reg.names()
    with pytest.raises(ValueError):
        reg.register(reg.get("attnlink"))  # duplicate name
    load_extra(reg, ["tests.engine.extra_analyzer:register"])
    assert "echo" in reg.names()
    with pytest.raises(ValueError):
        load_extra(AnalyzerRegistry(), ["tests.engine.no_such_module:register"])
    with pytest.raises(ValueError):
        load_extra(AnalyzerRegistry(), ["no-colon"])


def test_needs_become_a_capture_spec_and_are_checked_against_artifacts():
    need = CaptureNeed(qk_layers=(2,), heads=(1,), q_positions="last_prompt", k_positions="prompt")
    spec = capture_spec_for(need, None, max_bytes=10)
    assert spec.layers == [] and spec.attention == AttentionCaptureSpec(
        layers=[2], heads=[1], positions="prompt", q_positions="last_prompt"
    )
    # merged into the request's own capture: layers united, positions widened
    base = CaptureSpec(layers=[0], positions="completion", attention=AttentionCaptureSpec(layers=[1], heads=[0]))
    merged = capture_spec_for(CaptureNeed(layers=(3,), positions="last").merged(need), base)
    assert merged.layers == [0, 3] and merged.positions == "completion"
    assert merged.attention.layers == [1, 2] and merged.attention.heads == [0, 1]
    meta = {
        "layers": [0],
        "positions": "prompt",
        "attention": {"layers": [2], "heads": [0], "num_heads": 2, "positions": "prompt", "q_positions": "prompt"},
    }
    with pytest.raises(AnalyzerCaptureMissing) as missing:
        check_capture(meta, need, "attnlink")
    assert "heads [1]" in missing.value.message
    with pytest.raises(AnalyzerCaptureMissing):
        check_capture(meta, CaptureNeed(layers=(0,), positions="last"), "hidden_states")
    check_capture(meta, CaptureNeed(layers=(0,), positions="last_prompt"), "hidden_states")


def test_tracker_and_attnlink_end_to_end_on_the_tiny_model(engines, reference):  # noqa: F811
    eng = engines("tiny-llama")
    asset, model = reference("tiny-llama")
    reg = default_registry()
    tracker, link = reg.get("attention_tracker"), reg.get("attnlink")
    pt = tracker.prepare(
        {"layer_heads": {"1": [0, 1], "3": [1]}, "instruction": [0, 3], "data": [3, -1]}, AnalysisContext()
    )
    pl = link.prepare({"layer_heads": {"2": [1]}, "candidate_spans": [[0, 2], [2, 4], [4, 6]]}, AnalysisContext())
    spec = capture_spec_for(tracker.needs(pt).merged(link.needs(pl)), None)
    out = eng.generate_sync(job("e2e", spec))
    cap = load_capture(out.capture.data)
    check_capture(cap.meta, tracker.needs(pt), "attention_tracker")
    got = tracker.run(cap, pt, AnalysisContext())
    n = out.usage.prompt_tokens
    ref = reference_qk(asset, model, cap.meta["prompt_token_ids"])

    def attention(layer, head):  # from the independent reference, GQA: kv head = head // 2
        q, k = ref[layer][0][n - 1, head], ref[layer][1][:, head // 2]
        s = k @ q * eng.backend.attention_scaling(layer)
        e = np.exp(s - s.max())
        return e / e.sum()

    want = []
    for layer, head in ((1, 0), (1, 1), (3, 1)):
        a = attention(layer, head)
        want.append(a[0:3].sum() / (a[0:3].sum() + a[3 : n - 1].sum() + 1e-8))
    assert got["score"] == pytest.approx(np.mean(want), rel=1e-5)
    a = attention(2, 1)
    assert link.run(cap, pl, AnalysisContext())["scores"] == pytest.approx(
        [a[0:2].mean(), a[2:4].mean(), a[4:6].mean()], rel=1e-5
    )
