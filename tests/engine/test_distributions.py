"""Teacher-forced distributions (``GenerationJob.distributions_from``): the full next-token
log-softmax at prompt rows, against the test's own float64 forward of the checkpoint.

The reference loads the tiny checkpoint through transformers in float64 (no engine code),
runs the prompt through it (with the test's own forward hook adding ``strength ·
W_dec[i]`` at the steered block, in float64, when steered) and takes its own
``log_softmax``; row ``r`` of the answer predicts prompt token ``start + r`` and so is the
reference's row ``start + r - 1``. Serial and batched transformers engines, llama.cpp
(serial and batched) where it is installed, refusals by name, and arming the
distributions leaving the generated tokens alone.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_engine.api import backends
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    Capabilities,
    Distributions,
    GenerationJob,
    GenerationResult,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
    from_json,
    to_json,
    unpack_distributions,
)
from gpu_engine.backends import BackendEntry
from gpu_engine.backends.transformers.runner import TransformersRunner
from gpu_engine.runtime.engine import Engine

from .helpers import RefSAE, adding, count_forwards
from .tolerances import DISTRIBUTION_ATOL, POSITIVE_CONTROL_MIN

PROMPTS = ["the cat sat on the mat and then it", "a quick brown fox jumps over the lazy dog", "one two three four"]
SAE = "tiny-llama-L1-relu"
FEATURES = {3: 8.0, 17: -5.0}


# ---------------------------------------------------------------- the reference


@pytest.fixture(scope="module")
def reference(tiny_assets):
    """``lsm(ids, steer=None)``: the float64 log-softmax of every prompt row from the
    checkpoint loaded anew in float64; ``steer`` = (sae asset, {feature: strength})
    adds the decoder rows at that SAE's block output with the test's own hook."""
    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), torch_dtype=torch.float64)
    model.eval()

    def lsm(ids: list[int], steer: tuple[Any, dict[int, float]] | None = None) -> np.ndarray:
        hook = contextlib.nullcontext()
        if steer is not None:
            sae, features = steer
            delta = torch.tensor(RefSAE(sae).delta(features), dtype=torch.float64)
            module = model.get_submodule(asset.layer_module_path(sae.layer))
            hook = adding(module, delta)
        with torch.no_grad(), hook:
            logits = model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    return lsm


def assert_rows(d: Distributions | None, ref: np.ndarray, start: int, n_prompt: int, atol: float) -> np.ndarray:
    """``d`` holds the rows predicting prompt tokens ``start .. n_prompt - 1``, each the
    reference's row before that token."""
    assert d is not None
    assert (d.start, d.rows, d.vocab) == (start, n_prompt - start, ref.shape[1])
    got = unpack_distributions(d)
    assert got.dtype == np.float32 and got.shape == (n_prompt - start, ref.shape[1])
    np.testing.assert_allclose(got, ref[start - 1 : n_prompt - 1], atol=atol, rtol=0)
    return got


def job(rid: str, ids: list[int], start: int | None, *, n: int = 2, **kw: Any) -> GenerationJob:
    sampling = kw.pop("sampling", None) or SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerationJob(rid, prompt_token_ids=ids, sampling=sampling, distributions_from=start, **kw)


def steering(asset, features=FEATURES) -> SteeringSpec:
    return SteeringSpec.from_mapping({(asset.name, asset.layer): features})


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def batched_engine(engine_factory):
    return engine_factory("tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8))


@pytest.fixture(params=["serial", "batched"])
def eng(request, engine, batched_engine):
    """The serial (``engine``) and batched tiny-llama engines, no SAE before or after."""
    e = engine if request.param == "serial" else batched_engine
    e.detach(None)
    yield e
    e.detach(None)


def test_distributions_equal_the_float64_reference(eng, reference):
    for text in PROMPTS:
        ids = eng.backend.encode_text(text)
        ref = reference(ids)
        for start in (1, 3, len(ids) - 1):
            got = eng.generate_sync(job(f"d{start}", ids, start))
            rows = assert_rows(got.distributions, ref, start, len(ids), DISTRIBUTION_ATOL)
            # each row is a distribution over the whole vocabulary
            np.testing.assert_allclose(np.exp(rows.astype(np.float64)).sum(axis=1), 1.0, atol=1e-5)
        # the prompt_logprobs of the same prefill are the same rows' picks
        both = eng.generate_sync(
            job("lp", ids, 1, sampling=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
        )
        rows = unpack_distributions(both.distributions)
        np.testing.assert_allclose(both.prompt_logprobs[1:], rows[np.arange(len(ids) - 1), ids[1:]], atol=1e-6, rtol=0)


def test_without_the_field_nothing_is_sent(eng):
    ids = eng.backend.encode_text(PROMPTS[0])
    assert eng.generate_sync(job("none", ids, None)).distributions is None


def test_concurrent_requests_in_a_batch_each_get_their_own_rows(batched_engine, reference):
    """Several requests of different lengths at once (some with distributions, some
    without: those prefill in padded groups) each get their own prompt's rows."""
    eng = batched_engine
    eng.detach(None)
    jobs = []
    for i, text in enumerate(PROMPTS * 2):
        ids = eng.backend.encode_text(text)
        jobs.append((ids, job(f"c{i}", ids, (i % 3) + 1 if i % 2 == 0 else None, n=4)))
    streams = [eng.generate(j) for _, j in jobs]
    results = [GenerationResult.from_events(s.events(60)) for s in streams]
    for (ids, j), got in zip(jobs, results):
        if j.distributions_from is None:
            assert got.distributions is None
        else:
            assert_rows(got.distributions, reference(ids), j.distributions_from, len(ids), DISTRIBUTION_ATOL)


def test_steered_distributions_are_the_steered_forward(eng, reference, tiny_assets):
    """A steered teacher-forced pass: the rows of the test's own forward with
    ``strength · W_dec[i]`` added at the block, unlike the unsteered rows."""
    sae = tiny_assets.saes[SAE]
    eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    ids = eng.backend.encode_text(PROMPTS[0])
    start = 2
    plain_ref, steered_ref = reference(ids), reference(ids, (sae, FEATURES))
    assert np.abs(steered_ref - plain_ref).max() > POSITIVE_CONTROL_MIN  # the steer moves them
    plain = eng.generate_sync(job("u", ids, start))
    steered = eng.generate_sync(job("s", ids, start, steering=steering(sae)))
    assert_rows(plain.distributions, plain_ref, start, len(ids), DISTRIBUTION_ATOL)
    assert_rows(steered.distributions, steered_ref, start, len(ids), DISTRIBUTION_ATOL)
    assert np.abs(unpack_distributions(steered.distributions) - unpack_distributions(plain.distributions)).max() > (
        POSITIVE_CONTROL_MIN
    )
    assert [(c.layer, c.count) for c in steered.steering_apply_count] == [(sae.layer, steered.forward_passes)]


def test_monitoring_the_prompt_beside_distributions(eng, reference, tiny_assets):
    """A monitor reading the prompt rows and the distributions share the one prefill."""
    sae = tiny_assets.saes[SAE]
    eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    ids = eng.backend.encode_text(PROMPTS[1])
    monitor = MonitorSpec([MonitorEntry(sae.name, sae.layer, top_k=3, positions="prompt")])
    got = eng.generate_sync(job("m", ids, 1, monitor=monitor, steering=steering(sae)))
    assert_rows(got.distributions, reference(ids, (sae, FEATURES)), 1, len(ids), DISTRIBUTION_ATOL)
    assert sorted(r.position for r in got.activations) == list(range(len(ids)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_arming_distributions_leaves_the_generation_alone(eng, tiny_assets, temperature):
    """The same request with and without ``distributions_from``: the same tokens, text and
    token logprobs (a seeded sample too), steered and not."""
    sae = tiny_assets.saes[SAE]
    eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    ids = eng.backend.encode_text(PROMPTS[0])
    sampling = SamplingParams(
        max_tokens=12, temperature=temperature, seed=7, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    for spec in (None, steering(sae)):
        plain = eng.generate_sync(job("p", ids, None, sampling=sampling, steering=spec))
        armed = eng.generate_sync(job("a", ids, 2, sampling=sampling, steering=spec))
        assert armed.distributions is not None and plain.distributions is None
        assert armed.token_ids == plain.token_ids and armed.text == plain.text
        assert [lp.logprob for lp in armed.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-6)


# ---------------------------------------------------------------- bad values, refusals


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(InvalidParameter) as err:
        GenerationJob("b", prompt="x", distributions_from=bad)
    assert err.value.details["param"] == "distributions_from"
    with pytest.raises(InvalidParameter) as err:
        from_json(
            to_json({"request_id": "b", "prompt": "x", "distributions_from": bad}),
            GenerationJob,
        )
    assert err.value.details["param"] == "distributions_from"


def test_a_start_at_or_past_the_prompt_end_is_refused_before_anything_runs(eng):
    ids = eng.backend.encode_text(PROMPTS[2])
    for start in (len(ids), len(ids) + 5):
        with count_forwards(eng.backend.model) as n:
            [error] = list(eng.generate(job("late", ids, start)).events(30))
        assert n[0] == 0
        assert error.code == "invalid_parameter" and error.details["param"] == "distributions_from"
        assert error.details["prompt_tokens"] == len(ids)
    # a text prompt counts its tokens after encoding
    n_text = len(eng.backend.encode_text("the cat"))
    [error] = list(eng.generate(GenerationJob("t", prompt="the cat", distributions_from=n_text)).events(30))
    assert error.details["param"] == "distributions_from"


def test_more_rows_than_the_byte_bound_are_refused(eng, monkeypatch):
    """rows × vocab × 4 above ``MAX_DISTRIBUTION_BYTES``: refused naming the field with the
    figures, before anything runs; exactly at the bound it runs."""
    from gpu_engine.api import jobs

    ids = eng.backend.encode_text(PROMPTS[0])
    row = eng.backend.vocab_size * 4
    monkeypatch.setattr(jobs, "MAX_DISTRIBUTION_BYTES", 3 * row)
    with count_forwards(eng.backend.model) as n:
        [error] = list(eng.generate(job("big", ids, len(ids) - 4)).events(30))
    assert n[0] == 0
    assert error.code == "invalid_parameter" and error.details["param"] == "distributions_from"
    assert (error.details["rows"], error.details["max_bytes"]) == (4, 3 * row)
    assert eng.generate_sync(job("fits", ids, len(ids) - 3)).distributions.rows == 3


def test_unpack_refuses_bytes_that_disagree_with_the_sizes():
    with pytest.raises(ValueError):
        unpack_distributions(Distributions(start=1, rows=2, vocab=3, logprobs=b"\0" * 20))
    with pytest.raises(ValueError):
        unpack_distributions(Distributions(start=0, rows=1, vocab=1, logprobs=b"\0" * 4))
    d = Distributions(start=2, rows=1, vocab=2, logprobs=np.array([-0.5, -1.0], dtype="<f4").tobytes())
    np.testing.assert_array_equal(unpack_distributions(d), [[-0.5, -1.0]])


class _Without(TransformersRunner):
    """The transformers runner under another name, saying it has no distributions (the
    key left unset, as a plugged-in backend that does not know of them) or not (with a
    reason, as vLLM)."""

    name = "without"
    reason: str | None = None

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        if self.reason is None:
            return msgspec.structs.replace(caps, prompt_distributions=msgspec.UNSET)
        return msgspec.structs.replace(caps, prompt_distributions=False, prompt_distributions_reason=self.reason)


class _Refusing(_Without):
    name = "refusing"
    reason = "no full rows here"


def load_without(job, *, hooks):
    return _Without(job, hooks)


def load_refusing(job, *, hooks):
    return _Refusing(job, hooks)


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "batched"])
@pytest.mark.parametrize("name", ["without", "refusing"])
def test_a_backend_without_distributions_refuses_them_by_name(tiny_assets, monkeypatch, batched, name):
    entry = BackendEntry(
        name=name,
        summary="test",
        requires=("torch",),
        install="-",
        loader=f"tests.engine.test_distributions:load_{name}",
        options={},
    )
    monkeypatch.setitem(backends._BACKENDS, name, entry)
    asset = tiny_assets.models["tiny-llama"]
    with Engine(batching=BatchingOptions(enabled=batched)) as e:
        e.load_model(LoadModelJob("m", str(asset.path), dtype="float32", device="cpu", backend=name))
        ids = e.backend.encode_text(PROMPTS[0])
        with count_forwards(e.backend.model) as n:
            [error] = list(e.generate(job("r", ids, 2)).events(30))
        assert n[0] == 0
        assert error.code == "invalid_parameter" and error.details["param"] == "distributions_from"
        assert error.details["capability"] == "prompt_distributions" and name in error.message
        if name == "refusing":
            assert error.details["reason"] == "no full rows here"
        # the rest still runs
        assert len(e.generate_sync(job("ok", ids, None)).token_ids) == 2


def test_the_transformers_backend_reports_the_capability(engine):
    caps = engine.status().capabilities
    assert caps.prompt_distributions is True


@pytest.mark.parametrize(
    "options",
    [
        {"kv_cache_mode": "static"},
        {"lean_decode": False},
        {"speculative_model": "self:layers=2", "speculative_num_tokens": 3},
    ],
    ids=["static-kv", "no-lean", "speculative"],
)
def test_every_serial_decode_path_returns_them(tiny_assets, reference, options):
    """The serial path's other prefills (the static KV cache, model.forward steps, a
    speculative draft's verification) give the same rows and leave the tokens alone."""
    asset = tiny_assets.models["tiny-llama"]
    with Engine() as e:
        e.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu", options=options))
        ids = e.backend.encode_text(PROMPTS[0])
        plain = e.generate_sync(job("p", ids, None, n=8))
        got = e.generate_sync(job("d", ids, 2, n=8))
        assert_rows(got.distributions, reference(ids), 2, len(ids), DISTRIBUTION_ATOL)
        assert got.token_ids == plain.token_ids
        if "speculative_model" in options:
            assert got.speculative is not None and got.speculative.used  # the draft path ran


# ---------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "batched"])
def test_the_prefix_cache_never_serves_a_request_asking_for_distributions(tiny_assets, reference, batched):
    """The same prompt stored by an earlier request: a request asking for distributions
    prefills it whole (every row equals the reference) and is counted as bypassed."""
    asset = tiny_assets.models["tiny-llama"]
    with Engine(batching=BatchingOptions(enabled=True, max_batch_size=4) if batched else None) as e:
        e.load_model(
            LoadModelJob(
                "tiny-llama", str(asset.path), dtype="float32", device="cpu", options={"prefix_cache_max_mb": 64}
            )
        )
        ids = e.backend.encode_text(PROMPTS[1])
        e.generate_sync(job("warm", ids, None, n=3))
        e.generate_sync(job("hit", ids, None, n=3))  # positive control: the cache serves this prompt
        classes = e.status().memory["prefix_cache"]["classes"]["unsteered"]
        hits, bypassed = classes["hits"], classes["bypassed"]
        assert hits >= 1
        with count_forwards(e.backend.model) as n:
            got = e.generate_sync(job("d", ids, 1, n=1))
        assert n[0] == 1
        assert_rows(got.distributions, reference(ids), 1, len(ids), DISTRIBUTION_ATOL)
        after = e.status().memory["prefix_cache"]["classes"]["unsteered"]
        assert after["hits"] == hits and after["bypassed"] == bypassed + 1


# ---------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="module")
def gguf_engines(tiny_gguf):
    opts = {"kv_cache_type": "f32", "flash_attention": False}
    made = []
    for batching in (None, BatchingOptions(enabled=True, max_batch_size=8)):
        e = Engine(batching=batching)
        e.load_model(LoadModelJob("tiny-llama", str(tiny_gguf), device="cpu", backend="llamacpp", options=opts))
        made.append(e)
    yield made
    for e in made:
        e.shutdown()


def test_llamacpp_distributions_equal_the_float64_reference(gguf_engines, reference, tiny_assets):
    """Serial and batched llama.cpp, plain and steered (its control vector or eval
    callback), against the float64 forward of the checkpoint the GGUF was made from."""
    sae = tiny_assets.saes["tiny-llama-L2-jumprelu"]
    features = {5: 4.0, 9: -2.0}
    for e in gguf_engines:
        e.detach(None)
        assert e.status().capabilities.prompt_distributions is True
        e.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        try:
            for text in PROMPTS:
                ids = e.backend.encode_text(text)
                for start in (1, len(ids) - 2):
                    got = e.generate_sync(job("g", ids, start))
                    assert_rows(got.distributions, reference(ids), start, len(ids), DISTRIBUTION_ATOL)
                steered_ref = reference(ids, (sae, features))
                got = e.generate_sync(job("s", ids, 2, steering=steering(sae, features)))
                assert_rows(got.distributions, steered_ref, 2, len(ids), DISTRIBUTION_ATOL)
                plain = e.generate_sync(job("p", ids, None, n=6))
                armed = e.generate_sync(job("a", ids, 1, n=6))
                assert armed.token_ids == plain.token_ids
        finally:
            e.detach(None)


def test_requests_reading_their_prompt_rows_prefill_together(engine_factory, reference, monkeypatch):
    """Requests asking for distributions or prompt log-probabilities that arrive together
    share one padded prefill (one weight read, as plain requests do) and each still reads
    its own prompt's rows: the float64 reference's rows and log-probabilities."""
    from gpu_engine.backends.transformers import batched as batched_mod

    # the first prefill waits for the announced arrival (released once all are queued)
    eng = engine_factory("tiny-llama", batching=BatchingOptions(enabled=True, max_batch_size=8, gather_ms=10_000))
    seen: list[list[int]] = []
    real = batched_mod.prefill_groups

    def spy(seqs, vocab=1):
        groups = real(seqs, vocab)
        seen.extend([[s.echo_rows for s in g] for g in groups])
        return groups

    monkeypatch.setattr(batched_mod, "prefill_groups", spy)
    jobs = []
    for i, text in enumerate(PROMPTS * 2):
        ids = eng.backend.encode_text(text)
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=i % 2 == 1)
        jobs.append((ids, job(f"g{i}", ids, 2 if i % 2 == 0 else None, sampling=sampling)))
    with eng.arriving():
        streams = [eng.generate(j) for _, j in jobs]
    results = [GenerationResult.from_events(s.events(60)) for s in streams]
    assert any(len(g) > 1 and all(g) for g in seen), seen  # a group of several that all read rows
    for (ids, j), got in zip(jobs, results):
        ref = reference(ids)
        if j.distributions_from is not None:
            assert_rows(got.distributions, ref, 2, len(ids), DISTRIBUTION_ATOL)
        else:
            want = ref[np.arange(len(ids) - 1), ids[1:]]
            np.testing.assert_allclose(got.prompt_logprobs[1:], want, atol=DISTRIBUTION_ATOL, rtol=0)
