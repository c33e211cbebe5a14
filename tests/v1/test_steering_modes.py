"""Steering modes through /v1 with the official ``openai`` client: the request runs exactly
the engine spec it names (the same tokens as the engine run directly), the response says
what ran (entries, per-mode counts, where conditional steering fired, the canonical hash
in X-miLLM-Steering), and a bad control is refused with the field named."""

from __future__ import annotations

import pytest

from gpu_engine.api.protocol import (
    FeatureControl,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from tests.v1.helpers import assert_openai_error

# the request helpers and the attached-SAE fixture of the plain steering tests
from tests.v1.test_steering import PROMPT, _complete, _direct, relu  # noqa: E402,F401 - fixture


def _trigger(server, sae_id: str) -> tuple[int, float]:
    """A feature that fires at some of the prompt's rows, and a threshold between two of
    its observed values (read from an unsteered run's pre-steering monitor)."""
    probe = _direct(
        server,
        monitor=MonitorSpec([MonitorEntry(sae_id, 1, top_k=8, read_point="pre_steering", positions="prompt")]),
        max_tokens=1,
    )
    seen: dict[int, list[float]] = {}
    for rec in probe.activations:
        for f in rec.top_k:
            seen.setdefault(f.feature_index, []).append(f.activation)
    rows = len(probe.activations)
    feature = max(seen, key=lambda i: (0 < len(seen[i]) < rows, len(seen[i])))
    values = sorted(set(seen[feature]))
    return feature, ((values[0] + values[1]) / 2 if len(values) > 1 else values[0] / 2)


def test_modes_on_v1_run_the_named_spec_and_report_what_ran(relu, llama, openai_client):
    trigger, threshold = _trigger(llama, relu.id)
    features = [
        {"index": 3, "strength": 6.0},
        {"index": 17, "mode": "clamp", "value": 9.0},
        {"index": 40, "mode": "ablate", "phase": "completion"},
        {"index": 5, "mode": "scale", "value": 4.0, "window": {"start": 1, "end": 30}},
        {"index": 7, "mode": "clamp", "value": 12.0, "condition": {"feature": trigger, "threshold": threshold}},
    ]
    out = openai_client.completions.with_raw_response.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "steering": {"features": features}},
    )
    body = out.parse()
    spec = SteeringSpec(
        [
            SteeringEntry(
                relu.id,
                1,
                {3: 6.0},
                [
                    FeatureControl(17, mode="clamp", value=9.0),
                    FeatureControl(40, mode="ablate", phase="completion"),
                    FeatureControl(5, mode="scale", value=4.0, window=PositionRange(1, 30)),
                    FeatureControl(7, mode="clamp", value=12.0, condition=SteeringCondition(trigger, threshold)),
                ],
            )
        ]
    )
    want = _direct(llama, steering=spec)
    only_add = _direct(llama, steering=SteeringSpec([SteeringEntry(relu.id, 1, {3: 6.0})]))
    assert want.text != only_add.text  # positive control: the controls change the output
    assert body.choices[0].text == want.text
    assert out.headers["x-millm-steering"] == (
        f'inline;sae={relu.id};layer=1;features=5;controls=4;hash="{spec.canonical_hash()}"'
    )
    millm = body.model_extra["millm"]
    assert millm["steering"]["hash"] == spec.canonical_hash()
    assert millm["steering"]["entries"][0]["features"] == [
        {"index": 3, "strength": 6.0},
        {"index": 17, "mode": "clamp", "value": 9.0},
        {"index": 40, "mode": "ablate", "phase": "completion"},
        {"index": 5, "mode": "scale", "value": 4.0, "window": {"start": 1, "end": 30}},
        {"index": 7, "mode": "clamp", "value": 12.0, "condition": {"feature": trigger, "threshold": threshold}},
    ]
    n = want.forward_passes
    assert millm["steering_apply_count"] == [
        {"sae_id": relu.id, "layer": 1, "count": n, "modes": {"add": n, "clamp": n, "ablate": n, "scale": n}}
    ]
    (fired,) = want.steering_fired
    assert fired.positions  # the condition split the rows (threshold between two values)
    (got,) = millm["steering_fired"]
    prompt_rows = want.usage.prompt_tokens
    assert got == {
        "choice": 0,
        "sae_id": relu.id,
        "layer": 1,
        "index": 7,
        "mode": "clamp",
        "positions": fired.positions,
        "token_indices": [p - (prompt_rows - 1) for p in fired.positions if p >= prompt_rows - 1],
    }


def test_a_plain_add_spelled_as_a_mode_is_the_same_request(relu, llama):
    a = _complete(llama, steering={"features": [{"index": 3, "strength": 8.0}]})
    b = _complete(llama, steering={"features": [{"index": 3, "mode": "add", "value": 8.0}]})
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.headers["x-millm-steering"] == b.headers["x-millm-steering"]


def test_the_dial_scales_adds_and_leaves_levels_as_written(relu, llama):
    resp = _complete(
        llama,
        steering_intensity=0.5,
        steering={
            "features": [
                {"index": 3, "mode": "add", "value": 8.0, "phase": "completion"},
                {"index": 17, "mode": "clamp", "value": 9.0},
            ]
        },
    )
    spec = SteeringSpec(
        [
            SteeringEntry(
                relu.id,
                1,
                {},
                [FeatureControl(3, value=4.0, phase="completion"), FeatureControl(17, mode="clamp", value=9.0)],
            )
        ]
    )
    assert resp.json()["choices"][0]["text"] == _direct(llama, steering=spec).text
    assert resp.json()["millm"]["steering"]["hash"] == spec.canonical_hash()


@pytest.mark.parametrize(
    ("feature", "param"),
    [
        ({"index": 3, "mode": "boost", "value": 1}, "steering.features[0].mode"),
        ({"index": 3, "strength": 1, "phase": "decode"}, "steering.features[0].phase"),
        ({"index": 3, "mode": "clamp"}, "steering.features[0]"),
        ({"index": 3, "mode": "ablate", "value": 2}, "steering.features[0]"),
        ({"index": 3, "mode": "clamp", "value": 500}, "steering.features[0].value"),
        ({"index": 3, "strength": 1, "window": {"start": 5, "end": 2}}, "steering.features[0].window"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(relu, llama, feature, param):
    assert_openai_error(_complete(llama, steering={"features": [feature]}), 400, "invalid_parameter", param)


def test_controls_that_cannot_apply_are_refused_before_anything_runs(relu, llama):
    cond = {"index": 3, "mode": "clamp", "value": 1, "condition": {"feature": 256, "threshold": 0}}
    error = assert_openai_error(
        _complete(llama, steering={"features": [cond]}),
        400,
        "invalid_feature_index",
        "steering.features.condition.feature",
    )
    assert "256" in error["message"]
    far = {"index": 3, "strength": 1, "window": {"start": 100000}}
    assert_openai_error(
        _complete(llama, steering={"features": [far]}), 400, "invalid_parameter", "steering.features.window"
    )


def test_a_raw_vector_adds_and_ablates_on_v1_and_refuses_what_needs_an_encoder(llama, tmp_path):
    """A vector (decoder rows only) through /v1: add and ablate run as the engine runs them;
    clamp, scale and a condition are refused naming the field, before anything runs."""
    import numpy as np
    from safetensors.numpy import save_file

    from orchestration.services import sae_attach
    from registry.models import Model
    from registry.vectors import vector_import

    path = tmp_path / "v.safetensors"
    save_file({"layer.1": np.random.default_rng(5).normal(size=64).astype(np.float32) * 4}, str(path))
    row = vector_import(path=path, name="v1-vector", model=Model.objects.get(name="tiny-llama"))
    sae_attach(sae=row, layer=1)
    try:
        resp = _complete(llama, steering={"features": [{"index": 0, "strength": 3.0}]})
        spec = SteeringSpec([SteeringEntry(row.id, 1, {0: 3.0})])
        assert resp.json()["choices"][0]["text"] == _direct(llama, steering=spec).text != _direct(llama).text
        resp = _complete(llama, steering={"features": [{"index": 0, "mode": "ablate"}]})
        spec = SteeringSpec([SteeringEntry(row.id, 1, {}, [FeatureControl(0, mode="ablate")])])
        assert resp.json()["choices"][0]["text"] == _direct(llama, steering=spec).text
        for feature, param in (
            ({"index": 0, "mode": "clamp", "value": 1.0}, "steering.features.mode"),
            ({"index": 0, "mode": "scale", "value": 2.0}, "steering.features.mode"),
            ({"index": 0, "strength": 1.0, "condition": {"feature": 0, "threshold": 0}}, "steering.features.condition"),
        ):
            assert_openai_error(_complete(llama, steering={"features": [feature]}), 400, "invalid_parameter", param)
    finally:
        from orchestration.services import sae_detach

        sae_detach(sae=row)
