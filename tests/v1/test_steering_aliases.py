"""Steering shapes of other tools on /v1 (docs/api-v1.md, "Steering shapes from other
tools"), each sent through the official ``openai`` client's ``extra_body`` and compared
token for token with the native request it maps onto, with a positive control (the shape
really steers); the native inline vector compared with the feature whose decoder row it
is (read from the SAE's own files); every shape that cannot be mapped, two shapes in one
request and every malformed packed vector refused with 400 naming the field, nothing run."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from gpu_engine.api.protocol import SteeringEntry, SteeringSpec
from gpu_engine.api.steering import SteeringVector
from gpu_engine.api.vectors import pack
from tests.engine.helpers import RefSAE
from tests.v1.helpers import assert_openai_error, request
from tests.v1.test_batches import batch_server  # noqa: F401 - fixture
from tests.v1.test_steering import PROMPT, relu  # noqa: F401 - fixture

STRENGTH = 12.0


@pytest.fixture
def row(tiny_assets) -> np.ndarray:
    """W_dec[3] of the attached SAE, float32 as its file holds it."""
    return RefSAE(tiny_assets.saes["tiny-llama-L1-relu"]).W_dec[3].astype(np.float32)


def _tokens(client, *, path="completions", headers=None, **extra):
    """The completion's text and response headers for ``extra_body=extra``."""
    common = {"model": "tiny-llama", "max_tokens": 12, "temperature": 0}
    body = {"ignore_eos": True, **extra}
    if path == "chat":
        out = client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": PROMPT}], extra_body=body, extra_headers=headers, **common
        )
        return out.parse().choices[0].message.content, out.headers
    out = client.completions.with_raw_response.create(prompt=PROMPT, extra_body=body, extra_headers=headers, **common)
    return out.parse().choices[0].text, out.headers


def _raw(server, **extra):
    return request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **extra},
    )


def _native_feature(phase="all"):
    feature = {"index": 3, "strength": STRENGTH} if phase == "all" else {"index": 3, "value": STRENGTH, "phase": phase}
    return {"steering": {"features": [feature]}}


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_an_inline_vector_equal_to_a_decoder_row_steers_as_the_feature(relu, llama, openai_client, row, path):
    vector = (np.float32(STRENGTH) * row).astype(np.float32)
    got, headers = _tokens(openai_client, path=path, steering={"vectors": [{"data": pack(vector), "layer": 1}]})
    want, _ = _tokens(openai_client, path=path, **_native_feature())
    plain, _ = _tokens(openai_client, path=path)
    assert got == want
    assert got != plain  # positive control
    spec = SteeringSpec([SteeringEntry(relu.id, 1, {}, [], [SteeringVector(vector.tobytes(), "float32", 1.0)])])
    assert headers["x-millm-steering"].endswith(f'hash="{spec.canonical_hash()}"')
    # resid_pre of layer 2 is the same stream as resid_post of layer 1 (block 1's output)
    pre, _ = _tokens(
        openai_client, path=path, steering={"vectors": [{"data": pack(vector), "layer": 2, "hook": "resid_pre"}]}
    )
    assert pre == want
    # features and vectors in one object add up (6·W[3] twice is 12·W[3] exactly)
    half = (np.float32(STRENGTH / 2) * row).astype(np.float32)
    both, _ = _tokens(
        openai_client,
        path=path,
        steering={"features": [{"index": 3, "strength": STRENGTH / 2}], "vectors": [{"data": pack(half)}]},
    )
    assert both == want
    # a small vector may be a JSON list, and strength scales it
    listed, _ = _tokens(openai_client, path=path, steering={"vectors": [{"data": row.tolist(), "strength": STRENGTH}]})
    assert listed == want


@pytest.mark.parametrize(
    ("tier", "phase"),
    [("steering_vectors", "all"), ("prefill_steering_vectors", "prompt"), ("decode_steering_vectors", "completion")],
)
def test_the_rhizonymph_fork_tiers_are_vectors_of_their_phase(relu, llama, openai_client, row, tier, phase):
    packed = {**pack(row[None, :]), "layer_indices": [1], "scales": [STRENGTH]}
    got, headers = _tokens(openai_client, **{tier: {"post_block": packed}})
    native, _ = _tokens(
        openai_client, steering={"vectors": [{"data": pack(row), "layer": 1, "strength": STRENGTH, "phase": phase}]}
    )
    as_feature, _ = _tokens(openai_client, **_native_feature(phase))
    plain, _ = _tokens(openai_client)
    assert got == native == as_feature
    assert got != plain
    assert "x-millm-ignored-fields" not in headers  # the alias keys are read, not ignored
    # the layer-keyed JSON form of the same tier
    keyed, _ = _tokens(openai_client, **{tier: {"post_block": {"1": {"vector": row.tolist(), "scale": STRENGTH}}}})
    assert keyed == got


def test_easysteer_steering_object_and_false(relu, llama, openai_client, row):
    easy = {
        "vectors": [
            {
                "data": pack(row),
                "algorithm": "direct",
                "scale": STRENGTH,
                "layers": [1],
                "apply": {"prompt": "all", "generation": "none"},
            }
        ]
    }
    got, headers = _tokens(openai_client, steering=easy)
    want, _ = _tokens(openai_client, **_native_feature("prompt"))
    plain, _ = _tokens(openai_client)
    assert got == want != plain
    assert "x-millm-ignored-fields" not in headers
    off, _ = _tokens(openai_client, steering=False)
    assert off == plain


def test_neuronpedia_features_map_by_layer_source(relu, llama, openai_client):
    features = [{"model": "tiny-llama", "source": "1-res-jb", "index": 3, "strength": STRENGTH / 4}]
    got, headers = _tokens(openai_client, features=features, strength_multiplier=4, steer_method="SIMPLE_ADDITIVE")
    want, _ = _tokens(openai_client, **_native_feature())
    plain, _ = _tokens(openai_client)
    assert got == want != plain
    assert headers["x-millm-ignored-fields"] == '"features[0].model"'


def test_vllm_xargs_carry_millm_fields_and_vllm_lens_vectors(relu, llama, openai_client, row):
    want, _ = _tokens(openai_client, **_native_feature())
    plain, _ = _tokens(openai_client)
    steering = json.dumps(_native_feature()["steering"])
    got, headers = _tokens(openai_client, vllm_xargs={"steering": steering, "ngram_size": 30})
    assert got == want != plain
    assert headers["x-millm-ignored-fields"] == '"vllm_xargs.ngram_size"'
    lens = [{"activations": pack(row), "layer_indices": [1], "scale": STRENGTH}]
    got, _ = _tokens(openai_client, vllm_xargs={"apply_steering_vectors": json.dumps(lens)})
    assert got == want
    with pytest.raises(openai.BadRequestError) as err:
        _tokens(openai_client, headers={"X-miLLM-Strict": "true"}, vllm_xargs={"steering": steering, "ngram_size": 30})
    assert err.value.body["param"] == "vllm_xargs.ngram_size"


def test_the_alias_record_is_the_servers_own(relu, llama):
    resp = _raw(llama, steering_alias={"keys": ["user"]}, user="u")
    assert resp.status == 200
    assert resp.headers["x-millm-ignored-fields"] == '"user", "steering_alias"'


def _counts(server):
    return [a.steering_apply_count for a in server.engine.attachments()]


GOOD = {"dtype": "float32", "shape": [4], "data": base64.b64encode(b"\0" * 16).decode()}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # malformed packed vectors
        (
            {"steering": {"vectors": [{"data": {**GOOD, "data": base64.b64encode(b"\0" * 12).decode()}}]}},
            "steering.vectors[0].data.data",
        ),
        ({"steering": {"vectors": [{"data": {**GOOD, "dtype": "int8"}}]}}, "steering.vectors[0].data.dtype"),
        ({"steering": {"vectors": [{"data": {**GOOD, "data": "@@@@"}}]}}, "steering.vectors[0].data.data"),
        ({"steering": {"vectors": [{"data": [1.0, float("inf")]}]}}, "steering.vectors[0].data"),
        ({"steering": {"vectors": [{"data": GOOD, "layer": 1}]}}, "steering.vectors[0].data"),  # 4 wide
        ({"steering": {"vectors": [{"data": GOOD, "layer": 5}]}}, "steering.vectors[0].layer"),  # nothing hooked there
        (
            {"steering_vectors": {"post_block": {**GOOD, "shape": [2, 2], "layer_indices": [1]}}},
            "steering_vectors.post_block.shape",
        ),
        (
            {"steering_vectors": {"post_block": {**GOOD, "layer_indices": [1]}}},
            "steering_vectors.post_block.data",
        ),  # 4 wide
        # what cannot be mapped
        ({"steering_vectors": {"post_mlp": {"1": [1.0]}}}, "steering_vectors.post_mlp"),
        ({"steering_clamps": {"post_mlp": {"1": [{"vector": [1.0], "value": 1.0}]}}}, "steering_clamps.post_mlp"),
        ({"features": [{"source": "7-res-jb", "index": 3, "strength": 1}]}, "features[0].source"),
        (
            {"features": [{"source": "1-res-jb", "index": 3, "strength": 1}], "steer_method": "ORTHOGONAL_DECOMP"},
            "steer_method",
        ),
        ({"steering": {"vectors": [{"source": "/etc/passwd", "layers": [1]}]}}, "steering.vectors[0].source"),
        ({"vllm_xargs": {"apply_hooks": "gASV"}}, "vllm_xargs.apply_hooks"),
        ({"vllm_xargs": {"steering": "{not json"}}, "vllm_xargs.steering"),
        ({"vllm_xargs": {"steering": "[" * 100_000}}, "vllm_xargs.steering"),
        # two shapes in one request
        ({"steering": {"features": []}, "steering_vectors": {"post_block": {"1": [1.0]}}}, "steering_vectors"),
        (
            {
                "features": [{"source": "1-res-jb", "index": 3, "strength": 1}],
                "vllm_xargs": {"steering": '{"features": []}'},
            },
            "features",
        ),
        ({"steering": {"features": []}, "vllm_xargs": {"steering": '{"features": []}'}}, "vllm_xargs.steering"),
    ],
)
def test_what_cannot_be_mapped_is_a_400_naming_the_field_and_nothing_runs(relu, llama, extra, param):
    before = _counts(llama)
    resp = _raw(llama, **extra)
    assert resp.status == 400, resp.body[:300]
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert error["code"] in ("invalid_parameter", "sae_not_attached", "validation_error"), error
    assert "Traceback" not in error["message"]
    assert _counts(llama) == before  # no forward steered anything


def test_two_shapes_are_named_both(relu, llama):
    resp = _raw(llama, steering={"features": []}, steering_vectors={"post_block": {"1": [1.0]}})
    message = assert_openai_error(resp, 400, "invalid_parameter", "steering_vectors")["message"]
    assert "steering and steering_vectors" in message


def test_batch_lines_take_the_shapes_and_refuse_what_cannot_be_mapped(relu, batch_server, openai_client, row):
    from tests.v1.test_batches import output, upload, wait_status

    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    packed = {**pack(row[None, :]), "layer_indices": [1], "scales": [STRENGTH]}
    rows = [
        {
            "custom_id": "fork",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**body, "steering_vectors": {"post_block": packed}},
        },
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**body, "steering_vectors": {"post_mlp": packed}},
        },
    ]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, rows).id, endpoint="/v1/completions", completion_window="24h"
    )
    done = wait_status(openai_client, batch.id, ("completed", "failed"))
    lines = {x["custom_id"]: x for x in output(openai_client, done.output_file_id)}
    lines.update({x["custom_id"]: x for x in output(openai_client, done.error_file_id)})
    want, _ = _tokens(openai_client, **_native_feature())
    assert lines["fork"]["response"]["body"]["choices"][0]["text"] == want
    bad = lines["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "steering_vectors.post_mlp"
