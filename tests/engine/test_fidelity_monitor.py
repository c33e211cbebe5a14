"""The fidelity monitor (``MonitorEntry.fidelity``): how well the SAE reconstructs the rows
it reads — per row the non-zero features (l0), ``||x - x_hat||^2`` and ``||x||^2``, and the
rows' sum of ``x`` — one ``FidelityStats`` record per encoded chunk, in the finish event.

On the demo SmolLM2-135M with its layer-12 SAE (float32), on each backend that monitors —
transformers serial and batched, vLLM, llama.cpp (``MILLM_REQUIRE_VLLM`` /
``MILLM_REQUIRE_LLAMACPP`` make those required) — one concurrent batch holds a request read
for fidelity at every row it computes, with a prompt longer than one encoded chunk; its
unmonitored twin; and a request steered at the monitored layer read after the steering (its
rows move by the steering: the positive control).  The reference is the test's own: a
float32 transformers forward of the checkpoint over the same tokens (block ``layer``'s
output) encoded and decoded in float64 with the SAE file's weights.  The monitored
request's tokens equal its twin's, bit for bit.  The web's aggregates (L0, MSE, explained
variance) computed from the records equal the reference's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.monitoring import FidelityStats, unpack_fidelity
from gpu_engine.api.protocol import (
    ActivationRecord,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    from_builtins,
    from_json,
    to_builtins,
    to_json,
)
from gpu_engine.interp.monitors import FLUSH_CHUNK_ROWS

from .demo_batch import BACKENDS, LONG, N_TOKENS, STEER, demo, demo_engine, reference, steered_job  # noqa: F401 - fixtures
from .helpers import RefSAE

# each backend's float32 forward and encode/decode against the test's float64 of its own
# float32 forward, relative to the row's own squared norm (the error, the norm and the sum
# are sums of d_in = 576 squares or values of rows whose first one reads ~10^3): sq_err
# measured ≤ 8.0e-7 (transformers serial and batched, vLLM) and 1.1e-6 (llama.cpp)
REL = 1e-5
# a feature whose float64 pre-activation lies this close to its threshold may fall either
# side in float32: the engine's l0 may differ from the reference's by at most their count
EDGE = 1e-3


def ref_stats(ref: RefSAE, x: np.ndarray) -> dict[str, np.ndarray]:
    """The test's own fidelity of rows ``x`` (float64): SAELens's decode of its encode
    (the demo SAE rescales nothing), and how many pre-activations lie at a threshold."""
    acts = ref.encode(x)
    x_hat = acts @ ref.W_dec + ref.b_dec
    pre = (x - ref.b_dec if ref.apply_b_dec else x) @ ref.W_enc + ref.b_enc
    edge = np.abs(pre - (ref.threshold if ref.threshold is not None else 0.0)) < EDGE
    return {
        "l0": (acts != 0).sum(-1),
        "sq_err": ((x - x_hat) ** 2).sum(-1),
        "sq_norm": (x * x).sum(-1),
        "x_sum": x.sum(0),
        "edge": edge.sum(-1),
    }


def stats_of(records: list[ActivationRecord], rows: int) -> dict[str, np.ndarray]:
    """A request's fidelity records joined in row order (checking that they tile the rows
    and carry nothing else)."""
    parts: dict[str, list[np.ndarray]] = {"l0": [], "sq_err": [], "sq_norm": [], "x_sum": []}
    at = 0
    for rec in sorted(records, key=lambda r: r.position):
        assert rec.position == at and rec.token_index is None
        assert rec.top_k == [] and rec.features == [] and rec.packed is None
        f = rec.fidelity
        assert 1 <= f.rows <= FLUSH_CHUNK_ROWS
        l0, sq_err, sq_norm, x_sum = unpack_fidelity(f)
        for name, value in zip(parts, (l0, sq_err, sq_norm, x_sum[None])):
            parts[name].append(value.astype(np.float64))
        at += f.rows
    assert at == rows
    out = {name: np.concatenate(v) for name, v in parts.items()}
    out["x_sum"] = out["x_sum"].sum(0)
    return out


def check(got: dict, want: dict) -> None:
    scale = want["sq_norm"]
    assert (np.abs(got["l0"] - want["l0"]) <= want["edge"]).all()
    np.testing.assert_array_less(np.abs(got["sq_err"] - want["sq_err"]), REL * scale + 1e-6)
    np.testing.assert_array_less(np.abs(got["sq_norm"] - want["sq_norm"]), REL * scale + 1e-6)
    np.testing.assert_allclose(got["x_sum"], want["x_sum"], atol=REL * np.sqrt(scale.sum()))


def aggregates(s: dict, d_in: int) -> tuple[float, float, float]:
    """The web's figures (docs/monitoring.md): L0, MSE, explained variance."""
    rows = len(s["l0"])
    err = s["sq_err"].sum()
    total = s["sq_norm"].sum() - float(s["x_sum"] @ s["x_sum"]) / rows
    return float(s["l0"].mean()), float(err / (rows * d_in)), float(1 - err / total)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fidelity_records_equal_an_independent_reconstruction_inside_a_mixed_batch(demo, reference, backend):
    model, sae_asset = demo
    ref = RefSAE(sae_asset)
    key = (sae_asset.name, sae_asset.layer)
    tok = AutoTokenizer.from_pretrained(str(model.path))
    long_ids = tok(LONG * 12)["input_ids"]
    assert FLUSH_CHUNK_ROWS < len(long_ids) < 2 * FLUSH_CHUNK_ROWS  # two encoded chunks
    steer_ids = tok("The weather today is")["input_ids"]
    greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)

    def fidelity(read_point: str, positions: str) -> MonitorSpec:
        return MonitorSpec([MonitorEntry(*key, fidelity=True, read_point=read_point, positions=positions)])

    jobs = {
        "fid": GenerationJob(
            "fid", prompt_token_ids=long_ids, sampling=greedy, monitor=fidelity("pre_steering", "all")
        ),
        "twin": GenerationJob("twin", prompt_token_ids=long_ids, sampling=greedy),
        "post": steered_job("post", steer_ids, greedy, key, fidelity("post_steering", "prompt")),
    }
    with demo_engine(backend, model, sae_asset) as eng:
        streams = {name: eng.generate(job) for name, job in jobs.items()}
        got = {name: s.result(600) for name, s in streams.items()}

    # arming the fidelity monitor changes no token
    assert got["fid"].token_ids == got["twin"].token_ids
    assert len(got["fid"].token_ids) == N_TOKENS
    assert got["twin"].activations == []

    # every row the monitored request computed: the prompt and each decode step's input
    seq = long_ids + got["fid"].token_ids[:-1]
    assert len(got["fid"].activations) == 2  # 256 rows, then the rest
    want = ref_stats(ref, reference(seq))
    have = stats_of(got["fid"].activations, len(seq))
    print(backend, "largest sq_err rel error:", (np.abs(have["sq_err"] - want["sq_err"]) / want["sq_norm"]).max())
    print(backend, "l0 differs at", int((have["l0"] != want["l0"]).sum()), "rows of", len(seq))
    check(have, want)
    # the comparison is not vacuous: features fire and the SAE leaves an error at every row
    assert (want["l0"] > 0).all() and (want["sq_err"] > 0).all()
    d_in = ref.W_dec.shape[1]
    for mine, theirs in zip(aggregates(have, d_in), aggregates(want, d_in)):
        assert abs(mine - theirs) <= 1e-4 * max(1.0, abs(theirs))

    # after the steering the rows read are the steered ones (positive control: they move)
    h = reference(steer_ids)
    steered = stats_of(got["post"].activations, len(steer_ids))
    check(steered, ref_stats(ref, h + STEER * ref.W_dec[0]))
    assert np.abs(steered["x_sum"] - h.sum(0)).max() > 1.0


def test_a_fidelity_entry_takes_neither_top_k_features_packed_nor_streams():
    for extra in ({"top_k": 5}, {"features": [1]}, {"packed": True}, {"stream": True}):
        with pytest.raises(InvalidParameter) as refused:
            MonitorEntry("s", 0, fidelity=True, **extra)
        assert refused.value.param == "monitor.fidelity"
        body = {"sae_id": "s", "layer": 0, "fidelity": True, **extra}
        with pytest.raises(InvalidParameter) as refused:
            from_json(json.dumps(body), MonitorEntry)
        assert refused.value.param == "monitor.fidelity"
    entry = MonitorEntry("s", 0, fidelity=True)  # needs nothing else
    assert entry.fidelity and entry.top_k == 0 and entry.features == [] and not entry.packed


def _stats(rows: int, d_in: int) -> FidelityStats:
    return FidelityStats(
        rows,
        np.arange(rows, dtype="<i4").tobytes(),
        np.full(rows, 0.5, dtype="<f4").tobytes(),
        np.full(rows, 2.0, dtype="<f4").tobytes(),
        np.ones(d_in, dtype="<f4").tobytes(),
    )


def test_unpack_fidelity_refuses_bytes_that_do_not_agree():
    l0, sq_err, sq_norm, x_sum = unpack_fidelity(_stats(3, 4))
    assert l0.tolist() == [0, 1, 2] and sq_err.tolist() == [0.5] * 3 and sq_norm.tolist() == [2.0] * 3
    assert x_sum.tolist() == [1.0] * 4
    good = _stats(3, 4)
    for bad in (
        FidelityStats(4, good.l0, good.sq_err, good.sq_norm, good.x_sum),  # rows the arrays lack
        FidelityStats(3, good.l0[:8], good.sq_err, good.sq_norm, good.x_sum),
        FidelityStats(3, good.l0, good.sq_err, good.sq_norm[:4], good.x_sum),
        FidelityStats(3, good.l0, good.sq_err, good.sq_norm, b""),
        FidelityStats(3, good.l0, good.sq_err, good.sq_norm, good.x_sum[:5]),
        FidelityStats(0, b"", b"", b"", good.x_sum),
    ):
        with pytest.raises(ValueError):
            unpack_fidelity(bad)


def test_a_fidelity_record_crosses_json_and_builtins_intact():
    """The Redis transport encodes records as JSON; vLLM's workers hand them back as
    builtins (``vllm/wire.py``): the bytes arrive unchanged both ways."""
    rec = ActivationRecord("s", 2, "post_steering", 256, fidelity=_stats(3, 4))
    assert from_json(to_json(rec), ActivationRecord) == rec
    assert from_builtins(to_builtins(rec), ActivationRecord) == rec
    from gpu_engine.backends.vllm import wire

    assert wire.records_from([to_builtins(rec)]) == [rec]
