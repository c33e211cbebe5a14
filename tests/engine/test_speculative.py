"""Speculative decoding (SPECULATIVE_MODEL) on the serial path: greedy output, monitoring
records and steering are exactly those of plain decoding, with and without steering; only
the number of main-model forward passes changes. The references are runs of the same
model on an engine without a draft."""

from __future__ import annotations

import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

PROMPTS = [
    "the cat sat on the mat and",
    "one two three four five six seven",
    "a quick brown fox jumps over the lazy dog while the sun",
]


def _engine(tiny_assets, draft: str | None, k: int = 4) -> Engine:
    asset = tiny_assets.models["tiny-llama"]
    options = {"speculative_model": draft, "speculative_num_tokens": k} if draft else {}
    eng = Engine()
    eng.load_model(LoadModelJob("tiny-llama", str(asset.path), dtype="float32", device="cpu", options=options))
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    return eng


@pytest.fixture(scope="module")
def plain(tiny_assets):
    eng = _engine(tiny_assets, None)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def all_layers(tiny_assets):
    eng = _engine(tiny_assets, "self:layers=4")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def half(tiny_assets):
    eng = _engine(tiny_assets, "self:layers=2", k=5)
    yield eng
    eng.shutdown()


def job(rid: str, prompt: str, n: int, *, steering=None, monitor=None, **sampling) -> GenerationJob:
    params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **sampling}
    return GenerationJob(rid, prompt=prompt, sampling=SamplingParams(**params), steering=steering, monitor=monitor)


def steer(tiny_assets, features):
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    return SteeringSpec.from_mapping({(sae.name, sae.layer): features})


def monitor(tiny_assets, positions="all", stream=False):
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    return MonitorSpec(
        [
            MonitorEntry(
                sae.name,
                sae.layer,
                top_k=5,
                features=[0, 7, 100],
                read_point="post_steering",
                positions=positions,
                stream=stream,
            )
        ]
    )


def records(result):
    return [(r.position, r.token_index, [f.feature_index for f in r.top_k]) for r in result.activations]


def same_records(got, ref) -> None:
    """Positions and top-k features equal; activations within float32 noise (a verified
    row comes from a forward over several rows, a plain one from a forward over one)."""
    assert records(got) == records(ref)
    for a, b in zip(got.activations, ref.activations):
        values = [f.activation for f in (*a.top_k, *a.features)]
        expected = [f.activation for f in (*b.top_k, *b.features)]
        assert values == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_a_draft_that_is_the_model_itself_is_always_accepted(plain, all_layers):
    """Positive control: the draft of all 4 blocks, unsteered, is the main model: every
    draft is accepted, the tokens are plain decoding's, and forwards drop by ~k+1."""
    for i, prompt in enumerate(PROMPTS):
        ref = plain.generate_sync(job(f"p{i}", prompt, 40))
        got = all_layers.generate_sync(job(f"s{i}", prompt, 40))
        assert got.token_ids == ref.token_ids
        spec = got.speculative
        assert spec.used and spec.drafted > 0 and spec.accepted == spec.drafted
        # 1 prefill + ceil(39 / 5) verifications against 40 plain forwards
        assert got.forward_passes == 1 + -(-39 // 5)
        assert ref.forward_passes == 40


@pytest.mark.parametrize("features", [None, {3: 8.0, 17: -5.0}, {40: -6.0, 41: 4.0}])
def test_greedy_tokens_and_monitoring_equal_plain_decoding_with_and_without_steering(
    tiny_assets, plain, half, features
):
    steering = steer(tiny_assets, features) if features else None
    for i, prompt in enumerate(PROMPTS):
        ref = plain.generate_sync(job(f"p{i}", prompt, 48, steering=steering, monitor=monitor(tiny_assets)))
        got = half.generate_sync(job(f"s{i}", prompt, 48, steering=steering, monitor=monitor(tiny_assets)))
        assert got.token_ids == ref.token_ids
        same_records(got, ref)
        assert got.speculative.used and got.speculative.drafted > 0
        if features:
            # steering applied at every main forward pass, as in plain decoding
            (count,) = got.steering_apply_count
            assert count.count == got.forward_passes


def test_a_half_model_draft_is_sometimes_rejected_and_that_changes_nothing(tiny_assets, plain, half):
    """The 2-block draft disagrees with the 4-block model somewhere in these runs (else the
    equality tests above would not test rejection)."""
    rejected = 0
    for i, prompt in enumerate(PROMPTS):
        got = half.generate_sync(job(f"s{i}", prompt, 48))
        rejected += got.speculative.drafted - got.speculative.accepted
    assert rejected > 0


@pytest.mark.parametrize("positions", ["last", "completion"])
def test_streamed_and_last_position_monitors_see_only_accepted_rows(tiny_assets, plain, half, positions):
    steering = steer(tiny_assets, {3: 8.0})
    for stream in (False, True):
        if positions == "last" and stream:
            continue
        mon = monitor(tiny_assets, positions=positions, stream=stream)
        ref = plain.generate_sync(job("p", PROMPTS[2], 30, steering=steering, monitor=mon))
        got = half.generate_sync(job("s", PROMPTS[2], 30, steering=steering, monitor=mon))
        assert got.token_ids == ref.token_ids
        same_records(got, ref)


def test_stop_sequences_max_tokens_and_logit_bias_are_honoured(tiny_assets, plain, half):
    base = plain.generate_sync(job("p", PROMPTS[0], 30))
    stop_word = base.text.split()[3] if len(base.text.split()) > 3 else base.text[:3]
    for kwargs in (
        {"stop": [stop_word]},
        {"logit_bias": {base.token_ids[2]: -100.0}},
        {"repetition_penalty": 1.3},
        {"max_tokens": 7},
    ):
        n = kwargs.pop("max_tokens", 30)
        ref = plain.generate_sync(job("p", PROMPTS[0], n, **kwargs))
        got = half.generate_sync(job("s", PROMPTS[0], n, **kwargs))
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason), kwargs


def test_sampled_requests_decode_plainly_and_say_why(plain, half):
    sampled = {"temperature": 0.8, "seed": 7}
    ref = plain.generate_sync(job("p", PROMPTS[1], 20, **sampled))
    got = half.generate_sync(job("s", PROMPTS[1], 20, **sampled))
    assert got.token_ids == ref.token_ids
    assert got.speculative.used is False and got.speculative.reason == "sampling"
    assert got.forward_passes == ref.forward_passes


def test_a_bad_draft_is_refused_at_load(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    eng = Engine()
    try:
        with pytest.raises(InvalidParameter) as err:
            eng.load_model(
                LoadModelJob(
                    "tiny-llama",
                    str(asset.path),
                    dtype="float32",
                    device="cpu",
                    options={"speculative_model": "self:layers=9"},
                )
            )
        assert err.value.details["param"] == "options.speculative_model"
        assert eng.status().state == "empty"
    finally:
        eng.shutdown()
