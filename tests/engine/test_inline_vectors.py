"""Inline raw steering vectors (``SteeringEntry.vectors``, docs/steering.md "Inline
vectors"): the block output the engine hands on is the residual plus ``strength · v`` on
the rows the phase selects, checked against float64 numpy from the vector's own bytes; a
vector equal to ``s · W_dec[i]`` (read from the SAE's files) steers exactly as feature i at
strength s; malformed vectors are refused naming the field, before anything runs."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import AttachSpec, GenerationJob, SamplingParams, SteeringEntry, SteeringSpec
from gpu_engine.api.steering import SteeringVector
from gpu_engine.api.vectors import pack, unpack

from .helpers import RefSAE, block, capture
from .tolerances import HOOK_ATOL, HOOK_RTOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"


@pytest.fixture
def attached(engine, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    return engine, model, sae, RefSAE(sae)


def _job(sae, vectors=(), features=None, max_tokens=6) -> GenerationJob:
    spec = SteeringSpec([SteeringEntry(sae.name, sae.layer, features or {}, [], list(vectors))])
    return GenerationJob(
        "v",
        prompt=PROMPT,
        steering=spec,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _run(engine, model, sae, vectors):
    module = block(engine, model, sae.layer)
    with capture(module, before_engine=True) as raw, capture(module) as post:
        out = engine.generate_sync(_job(sae, vectors))
    return out, np.concatenate(raw, axis=0), np.concatenate(post, axis=0)


def _vector(width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(width).astype(np.float32)


def test_a_vector_is_added_at_every_row_scaled_by_its_strength(attached):
    engine, model, sae, ref = attached
    v = _vector(ref.W_dec.shape[1])
    out, raw, post = _run(engine, model, sae, [SteeringVector(v.tobytes(), "float32", 3.0)])
    want = raw + 3.0 * v.astype(np.float64)
    np.testing.assert_allclose(post, want, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    assert np.abs(post - raw).max() > POSITIVE_CONTROL_MIN
    assert out.steering_apply_count[0].count == out.forward_passes


def test_phases_choose_the_rows_and_half_precision_is_read_as_sent(attached):
    engine, model, sae, ref = attached
    v16 = _vector(ref.W_dec.shape[1], seed=1).astype(np.float16)
    values = v16.astype(np.float64)  # what float16 holds, not the float32 it came from
    out, raw, post = _run(engine, model, sae, [SteeringVector(v16.tobytes(), "float16", 2.0, "completion")])
    p = out.usage.prompt_tokens
    np.testing.assert_array_equal(post[:p], raw[:p])
    np.testing.assert_allclose(post[p:], raw[p:] + 2.0 * values, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    out, raw, post = _run(engine, model, sae, [SteeringVector(v16.tobytes(), "float16", 2.0, "prompt")])
    np.testing.assert_allclose(post[:p], raw[:p] + 2.0 * values, atol=HOOK_ATOL, rtol=HOOK_RTOL)
    np.testing.assert_array_equal(post[p:], raw[p:])


def test_bfloat16_bytes_are_the_top_halves_of_float32(attached):
    engine, model, sae, ref = attached
    v = _vector(ref.W_dec.shape[1], seed=2)
    top = (v.view(np.uint32) >> 16).astype("<u2")
    values = (top.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    out, raw, post = _run(engine, model, sae, [SteeringVector(top.tobytes(), "bfloat16", 1.0)])
    np.testing.assert_allclose(post, raw + values, atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_a_decoder_row_as_a_vector_steers_exactly_as_the_feature(attached):
    engine, model, sae, ref = attached
    row = (np.float32(12.0) * ref.W_dec[3].astype(np.float32)).astype(np.float32)
    as_vector = engine.generate_sync(_job(sae, [SteeringVector(row.tobytes(), "float32", 1.0)], max_tokens=12))
    as_feature = engine.generate_sync(_job(sae, features={3: 12.0}, max_tokens=12))
    plain = engine.generate_sync(
        GenerationJob("p", prompt=PROMPT, sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    )
    assert as_vector.token_ids == as_feature.token_ids
    assert as_vector.token_ids != plain.token_ids  # positive control


def test_a_vector_of_the_wrong_width_is_refused_before_anything_runs(attached):
    engine, model, sae, ref = attached
    width = ref.W_dec.shape[1]
    module = block(engine, model, sae.layer)
    with capture(module) as seen, pytest.raises(InvalidParameter) as err:
        engine.generate_sync(_job(sae, [SteeringVector(_vector(width + 1).tobytes(), "float32", 1.0)]))
    assert err.value.param == "steering.vectors.data"
    assert seen == []  # no forward ran


@pytest.mark.parametrize(
    ("data", "dtype", "param"),
    [
        (np.array([1.0, np.nan], np.float32).tobytes(), "float32", "steering.vectors.data"),
        (np.array([np.inf], np.float16).tobytes(), "float16", "steering.vectors.data"),
        (b"\x00\x00\x80", "float32", "steering.vectors.data"),  # not a whole value
        (b"", "float32", "steering.vectors.data"),
    ],
)
def test_bad_bytes_are_refused_when_the_struct_is_built(data, dtype, param):
    with pytest.raises(InvalidParameter) as err:
        SteeringVector(data, dtype, 1.0)
    assert err.value.param == param


def test_the_hash_names_the_vector_by_its_bytes_strength_and_phase():
    v = np.arange(4, dtype=np.float32)
    spec = SteeringSpec([SteeringEntry("s", 1, {2: 1.5}, [], [SteeringVector(v.tobytes(), "float32", 2.0)])])
    import hashlib
    import struct

    digest = hashlib.sha256(v.tobytes()).hexdigest()
    assert spec.canonical_text() == (
        f"s\t1\tvector\tdtype=float32\tsha256={digest}\tstrength={struct.pack('>d', 2.0).hex()}\n"
        f"s\t1\t2\t{struct.pack('>d', 1.5).hex()}\n"
    )
    other = SteeringSpec([SteeringEntry("s", 1, {2: 1.5}, [], [SteeringVector(v.tobytes(), "float32", 2.0, "prompt")])])
    assert other.canonical_hash() != spec.canonical_hash()
    # a strength of 0 adds nothing: the same hash as without the vector
    zero = SteeringSpec([SteeringEntry("s", 1, {2: 1.5}, [], [SteeringVector(v.tobytes(), "float32", 0.0)])])
    assert zero.canonical_hash() == SteeringSpec([SteeringEntry("s", 1, {2: 1.5})]).canonical_hash()


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"dtype": "float64", "shape": [2], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}, "v.dtype"),
        ({"dtype": "float32", "shape": [3], "data": base64.b64encode(b"\0" * 8).decode()}, "v.data"),
        ({"dtype": "float32", "shape": [2], "data": "!!!notbase64"}, "v.data"),
        ({"dtype": "float32", "shape": [2, 2], "data": base64.b64encode(b"\0" * 16).decode()}, "v.shape"),
        ({"dtype": "float32", "shape": [0], "data": ""}, "v.shape"),
        ({"dtype": "float32", "shape": [2], "data": "A" * 10_000}, "v.data"),
        ({"dtype": "float32", "shape": [2], "data": "AAAAAAAAAAA=", "extra": 1}, "v"),
        ([1.0, float("nan")], "v"),
        ("text", "v"),
    ],
)
def test_packed_values_are_checked_naming_the_field(value, param):
    with pytest.raises(InvalidParameter) as err:
        unpack(value, "v")
    assert err.value.param == param


def test_pack_and_unpack_round_trip_each_dtype():
    v = np.array([0.5, -2.0, 3.25], np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        got_dtype, rows, raw = unpack(pack(v, dtype), "v")
        assert got_dtype == dtype
        np.testing.assert_array_equal(rows[0], v)  # exactly representable in all three
        assert base64.b64encode(raw).decode() == pack(v, dtype)["data"]


def test_prefix_cache_keys_tell_vectors_apart_and_skip_completion_only_ones():
    from gpu_engine.decode.prefix_cache import UNSTEERED, phase_free, steering_key

    a, b = np.ones(4, np.float32), np.full(4, 2.0, np.float32)

    def spec(data, phase="all"):
        return SteeringSpec([SteeringEntry("s", 1, {}, [], [SteeringVector(data.tobytes(), "float32", 1.0, phase)])])

    assert steering_key(spec(a), 5) not in (UNSTEERED, steering_key(spec(b), 5))
    assert steering_key(spec(a, "prompt"), 5) != UNSTEERED
    assert steering_key(spec(a, "completion"), 5) == UNSTEERED  # the prompt's KV is the unsteered one
    assert phase_free(spec(a)) and not phase_free(spec(a, "completion"))


def test_vllm_prefix_cache_salts_tell_vectors_apart():
    from gpu_engine.backends.vllm.wire import request_args, steering_salt

    def salt(data, phase="all", n_prompt=5):
        spec = SteeringSpec([SteeringEntry("s", 1, {}, [], [SteeringVector(data.tobytes(), "float32", 1.0, phase)])])
        job = GenerationJob("j", prompt="x", steering=spec, sampling=SamplingParams(max_tokens=1))
        return steering_salt(request_args(job), {}, n_prompt=n_prompt)

    a, b = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    assert salt(a) is not None and salt(a) != salt(b)
    assert salt(a) == salt(a, n_prompt=9)  # an everywhere-vector steers a row whatever the prompt length
    assert salt(a, "completion") != salt(a, "completion", n_prompt=9)  # a phased one does not
