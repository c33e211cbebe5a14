"""Packed monitor entries (``MonitorEntry.packed``, what a feature dashboard reads): every
non-zero feature of every row read, as CSR bytes.

On the demo SmolLM2-135M with its SAE (float32), on each backend that monitors —
transformers serial and batched, vLLM, llama.cpp (``MILLM_REQUIRE_VLLM`` /
``MILLM_REQUIRE_LLAMACPP`` make those required) — one concurrent batch holds a packed
request with a prompt longer than one encoded chunk, read at every row it computes; a
request steered at the monitored layer read packed before the steering (its prompt rows
are the unsteered model's) and one read packed after it (the positive control: its values
move, by exactly the steering added); a top-k monitored request; and an unmonitored twin of
the packed one.  The reference is the test's own: a float32 transformers forward of the
checkpoint over the same tokens (block ``layer``'s output) encoded in float64 with the
SAE's file weights (``tests/engine/helpers.RefSAE``).  The packed request's tokens equal
its unmonitored twin's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.monitoring import PackedRows, unpack
from gpu_engine.api.protocol import (
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    from_json,
)
from gpu_engine.interp.monitors import FLUSH_CHUNK_ROWS

from .demo_batch import BACKENDS, LONG, N_TOKENS, STEER, demo, demo_engine, reference, steered_job  # noqa: F401 - fixtures
from .helpers import RefSAE

# the packed values vs the test's float64 encode of its own float32 forward: each
# backend's float32 (another matmul blocking, llama.cpp's own kernels) against one
# reference, on values up to a few hundred at the first row; measured ≤ 5.3e-4 overall
# and ≤ 2.7e-5 where |want| ≤ 1 (transformers serial and batched, vLLM, llama.cpp)
PACKED_ATOL = 1e-3
PACKED_RTOL = 1e-4


def dense(records, rows: int, d_sae: int) -> np.ndarray:
    """A request's packed records as one [rows, d_sae] matrix (checking each record's CSR
    and that the records tile the rows in order)."""
    out = np.zeros((rows, d_sae))
    at = 0
    for rec in sorted(records, key=lambda r: r.position):
        assert rec.position == at and rec.token_index is None and rec.top_k == [] and rec.features == []
        assert rec.packed.rows <= FLUSH_CHUNK_ROWS
        row_ptr, indices, values = unpack(rec.packed)
        assert row_ptr[0] == 0 and (np.diff(row_ptr) >= 0).all()
        for r in range(rec.packed.rows):
            cols = indices[row_ptr[r] : row_ptr[r + 1]]
            assert (np.diff(cols) > 0).all() and (cols < d_sae).all()
            vals = values[row_ptr[r] : row_ptr[r + 1]]
            assert (vals != 0).all()
            out[at + r, cols] = vals
        at += rec.packed.rows
    assert at == rows
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_equal_an_independent_encode_inside_a_mixed_batch(demo, reference, backend):
    model, sae_asset = demo
    ref = RefSAE(sae_asset)
    d_sae = ref.W_enc.shape[1]
    key = (sae_asset.name, sae_asset.layer)

    with demo_engine(backend, model, sae_asset) as eng:
        # prompts from the checkpoint's tokenizer on every backend (ids go in as ids)
        tok = eng.backend.encode_text if backend.startswith("transformers") else None
        if tok is None:
            from transformers import AutoTokenizer

            hf_tok = AutoTokenizer.from_pretrained(str(model.path))

            def tok(text):
                return hf_tok(text)["input_ids"]

        long_ids = tok(LONG * 12)
        assert FLUSH_CHUNK_ROWS < len(long_ids) < 2 * FLUSH_CHUNK_ROWS  # two encoded chunks
        steer_ids = tok("The weather today is")
        other_ids = tok("My favourite place to visit is")
        greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)

        def packed(read_point: str, positions: str) -> MonitorSpec:
            return MonitorSpec([MonitorEntry(*key, packed=True, read_point=read_point, positions=positions)])

        jobs = {
            "packed": GenerationJob(
                "packed", prompt_token_ids=long_ids, sampling=greedy, monitor=packed("pre_steering", "all")
            ),
            "twin": GenerationJob("twin", prompt_token_ids=long_ids, sampling=greedy),
            "pre": steered_job("pre", steer_ids, greedy, key, packed("pre_steering", "prompt")),
            "post": steered_job("post", steer_ids, greedy, key, packed("post_steering", "prompt")),
            "topk": GenerationJob(
                "topk",
                prompt_token_ids=other_ids,
                sampling=greedy,
                monitor=MonitorSpec([MonitorEntry(*key, top_k=5, positions="prompt")]),
            ),
        }
        streams = {name: eng.generate(job) for name, job in jobs.items()}
        got = {name: s.result(600) for name, s in streams.items()}

    # monitoring every row packed changes no token
    assert got["packed"].token_ids == got["twin"].token_ids
    assert len(got["packed"].token_ids) == N_TOKENS

    # every row the packed request computed: the prompt and each decode step's input
    seq = long_ids + got["packed"].token_ids[:-1]
    want = ref.encode(reference(seq))
    values = dense(got["packed"].activations, len(seq), d_sae)
    assert len(got["packed"].activations) == 2  # 256 rows, then the rest
    err = np.abs(values - want)
    print(backend, "largest |packed - reference|:", err.max(), "where |want| <= 1:", err[np.abs(want) <= 1].max())
    np.testing.assert_allclose(values, want, atol=PACKED_ATOL, rtol=PACKED_RTOL)
    # the comparison reads features that fire, at every row
    assert ((want > 0).sum(axis=1) > 0).all()

    # before the steering, a steered request's prompt rows are the unsteered model's
    h = reference(steer_ids)
    pre = dense(got["pre"].activations, len(steer_ids), d_sae)
    np.testing.assert_allclose(pre, ref.encode(h), atol=PACKED_ATOL, rtol=PACKED_RTOL)
    # after it they move (positive control), by exactly the steering added
    post = dense(got["post"].activations, len(steer_ids), d_sae)
    assert np.abs(post - pre).max() > 0.5
    np.testing.assert_allclose(post, ref.encode(h + STEER * ref.W_dec[0]), atol=PACKED_ATOL, rtol=PACKED_RTOL)
    # the request monitored top-k still gets its own records, none packed
    topk = got["topk"].activations
    assert len(topk) == len(other_ids) and all(r.packed is None and r.top_k for r in topk)


def test_a_packed_entry_takes_neither_top_k_nor_features_nor_streams():
    for extra in ({"top_k": 5}, {"features": [1]}, {"stream": True}):
        with pytest.raises(InvalidParameter) as refused:
            MonitorEntry("s", 0, packed=True, **extra)
        assert refused.value.details["param"] == "monitor"
        # the same refusal where the entry arrives as JSON (the Redis transport)
        body = {"sae_id": "s", "layer": 0, "packed": True, **extra}
        import json

        with pytest.raises(InvalidParameter):
            from_json(json.dumps(body), MonitorEntry)
    entry = MonitorEntry("s", 0, packed=True)  # needs neither
    assert entry.packed and entry.top_k == 0 and entry.features == []


def test_unpack_refuses_bytes_that_do_not_agree():
    row_ptr = np.array([0, 1, 3], dtype="<i4").tobytes()
    indices = np.array([4, 1, 7], dtype="<i4").tobytes()
    values = np.array([0.5, 1.5, 2.5], dtype="<f4").tobytes()
    got = unpack(PackedRows(2, row_ptr, indices, values))
    assert [a.tolist() for a in got] == [[0, 1, 3], [4, 1, 7], [0.5, 1.5, 2.5]]
    for bad in (
        PackedRows(3, row_ptr, indices, values),  # rows the row pointers do not have
        PackedRows(2, row_ptr, indices[:4], values),  # fewer indices than values
        PackedRows(2, row_ptr, indices[:8], values[:8]),  # pointers past the entries
    ):
        with pytest.raises(ValueError):
            unpack(bad)


def test_millm_sae_activations_skips_packed_records():
    """A packed record (a dashboard's) in a finish event never becomes a position of
    ``millm.sae_activations``; the request's own top-k record does (positive control)."""
    from gpu_engine.api.protocol import ActivationRecord, AttachmentStatus, FeatureActivation
    from inference.activations import activations_payload

    att = AttachmentStatus("s", 1, "model.layers.1", 4, 8, "relu", "saelens", "/x")
    own = ActivationRecord("s", 1, "post_steering", 1, None, top_k=[FeatureActivation(3, 0.5)])
    blob = PackedRows(
        2,
        np.array([0, 1, 1], dtype="<i4").tobytes(),
        np.array([2], dtype="<i4").tobytes(),
        np.array([1.0], dtype="<f4").tobytes(),
    )
    packed = ActivationRecord("s", 1, "post_steering", 0, packed=blob)
    payload = activations_payload(
        records=[packed, own],
        attachment=att,
        read_point="post_steering",
        prompt_ids=[7, 8],
        token_ids=[9],
        prompt_tokens=["a", "b"],
        tokens=["c"],
    )
    assert [(p["position"], p["top_k"]) for p in payload["positions"]] == [
        (1, [{"feature_index": 3, "activation": 0.5}])
    ]
