"""Structured output (``SamplingParams.structured``): xgrammar masks on the demo model.

Every output is checked with ``jsonschema`` (an independent validator), never with the
grammar that produced it.  The batch test checks that a grammar mask touches its own row
only: the structured request and its unconstrained and steered neighbours each produce
their solo tokens.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import jsonschema
import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.capabilities import Capabilities
from gpu_engine.api.errors import InvalidParameter, ResponseFormatUnsupported
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    SteeringSpec,
    StructuredOutput,
)
from gpu_engine.runtime.prepare import check_capabilities
from tests.batching.conftest import Choreography
from tests.engine.structured_cases import COMPILE_TIMEOUT_S, SCHEMAS, structured_job

pytestmark = pytest.mark.demo_model


@pytest.fixture(scope="module")
def demo_engine(demo_assets):
    eng = Engine(
        on_event=lambda e: None,
        batching=BatchingOptions(enabled=True, max_batch_size=24),
        structured_timeout_s=COMPILE_TIMEOUT_S,
    )
    asset = demo_assets.models["smollm2-135m"]
    eng.load_model(LoadModelJob(asset.name, str(asset.path), dtype="float32", device="cpu"))
    sae = demo_assets.saes["smollm2-135m-L12-demo"]
    eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
    eng.sae = sae  # type: ignore[attr-defined]
    yield eng
    eng.shutdown()


def test_twenty_schemas_parse_and_validate(demo_engine):
    started = time.monotonic()
    streams = [demo_engine.generate(structured_job(f"s{i}", what, schema)) for i, (what, schema) in enumerate(SCHEMAS)]
    results = [s.result(timeout_s=240) for s in streams]
    for (what, schema), res in zip(SCHEMAS, results):
        assert res.finish_reason == "stop", (what, res.text)
        jsonschema.validate(json.loads(res.text), schema)
    # sampled decoding respects the mask too
    sampled = [
        demo_engine.generate(structured_job(f"t{i}", what, schema, temperature=1.0, seed=i))
        for i, (what, schema) in enumerate(SCHEMAS[:6])
    ]
    for (what, schema), stream in zip(SCHEMAS[:6], sampled):
        res = stream.result(timeout_s=240)
        assert res.finish_reason == "stop", (what, res.text)
        jsonschema.validate(json.loads(res.text), schema)
    assert time.monotonic() - started < 120


def test_json_object_is_a_json_object_and_ends_with_stop(demo_engine):
    res = demo_engine.generate_sync(
        structured_job("o", "a person with a name and an age", None, max_tokens=200), timeout_s=240
    )
    assert res.finish_reason == "stop", res.text
    assert isinstance(json.loads(res.text), dict)
    # positive control: unconstrained, the same prompt is not JSON
    plain = demo_engine.generate_sync(
        GenerationJob(
            "p",
            messages=[{"role": "user", "content": "Answer with JSON: a person with a name and an age."}],
            sampling=SamplingParams(max_tokens=30, temperature=0.0),
        ),
        timeout_s=240,
    )
    with pytest.raises(ValueError):
        json.loads(plain.text)


def test_a_grammar_masks_only_its_own_row_in_a_mixed_batch(demo_engine):
    sae = demo_engine.sae
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    jobs = {
        "plain": GenerationJob("plain", prompt="The weather today is", sampling=greedy),
        "steered": GenerationJob(
            "steered",
            prompt="My favourite food is",
            sampling=greedy,
            steering=SteeringSpec.from_mapping({(sae.name, sae.layer): {0: 12.0, 3: -8.0}}),
        ),
        "json": structured_job("json", "a task", SCHEMAS[13][1], max_tokens=60),
        "sampled": structured_job("sampled", "a person", SCHEMAS[0][1], max_tokens=60, temperature=0.9, seed=7),
    }
    solo = {name: demo_engine.generate_sync(job, timeout_s=240) for name, job in jobs.items()}
    choreo = Choreography(demo_engine.backend.model)
    streams = {}
    choreo.on(2, lambda: streams.__setitem__("json", demo_engine.generate(jobs["json"])))
    choreo.on(4, lambda: streams.__setitem__("sampled", demo_engine.generate(jobs["sampled"])))
    with choreo.installed():
        streams["plain"] = demo_engine.generate(jobs["plain"])
        streams["steered"] = demo_engine.generate(jobs["steered"])
        deadline = time.monotonic() + 60
        while len(streams) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.005)
        mixed = {name: streams[name].result(timeout_s=240) for name in jobs}
    assert max(choreo.batch_sizes) == 4  # they shared forward passes
    for name in jobs:
        assert mixed[name].token_ids == solo[name].token_ids, name
        assert mixed[name].finish_reason == solo[name].finish_reason
    for name in ("json", "sampled"):
        assert mixed[name].finish_reason == "stop"
        jsonschema.validate(json.loads(mixed[name].text), SCHEMAS[13 if name == "json" else 0][1])
    # positive control: without its grammar the structured prompt says something else
    free = GenerationJob(
        "free", messages=jobs["json"].messages, sampling=SamplingParams(max_tokens=60, temperature=0.0)
    )
    assert demo_engine.generate_sync(free, timeout_s=240).token_ids != solo["json"].token_ids


def test_the_serial_path_masks_the_same(demo_assets):
    eng = Engine(on_event=lambda e: None, structured_timeout_s=COMPILE_TIMEOUT_S)
    asset = demo_assets.models["smollm2-135m"]
    eng.load_model(LoadModelJob(asset.name, str(asset.path), dtype="float32", device="cpu"))
    try:
        what, schema = SCHEMAS[8]
        res = eng.generate_sync(structured_job("serial", what, schema), timeout_s=240)
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), schema)
    finally:
        eng.shutdown()


def test_a_schema_the_compiler_refuses_is_response_format_unsupported(demo_engine):
    bad = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    job = GenerationJob("bad", prompt="x", sampling=SamplingParams(max_tokens=4, structured=bad))
    with pytest.raises(ResponseFormatUnsupported) as caught:
        demo_engine.generate_sync(job, timeout_s=60)
    assert caught.value.details["param"] == "response_format"
    assert "ookbehind" in caught.value.message


def test_a_backend_without_grammars_is_refused_before_anything_runs():
    """Every backend here honours structured output (their own tests); one that reports
    ``structured_output`` false is refused by name before anything runs."""
    backend = SimpleNamespace(name="stand-in", capabilities=lambda: Capabilities(structured_output=False))
    job = GenerationJob("r", prompt="x", sampling=SamplingParams(structured=StructuredOutput("json_object")))
    with pytest.raises(InvalidParameter) as caught:
        check_capabilities(backend, job)
    assert caught.value.param == "response_format"
    check_capabilities(backend, GenerationJob("r", prompt="x", sampling=SamplingParams()))
