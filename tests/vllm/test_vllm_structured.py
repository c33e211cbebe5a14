"""Structured output and tool calls on the vLLM backend: each request's grammar
(``gpu_engine.decode.grammar``) rides in its own vLLM ``SamplingParams`` to vLLM's xgrammar
backend, which masks that request's row inside vLLM's batch.

The schemas run on the demo SmolLM2-135M checkpoint, as on the transformers backend (a
random tiny model writes digits until ``max_tokens`` wherever a number is unbounded); tool
calls on tiny-llama-tools (``<tool_call>`` tokens, a Hermes template that renders tools),
whose random weights make only the grammar write valid calls.  ``jsonschema`` checks every
output, never the grammar that made it.  Fails instead of skipping where
``MILLM_REQUIRE_VLLM=1``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import ResponseFormatUnsupported
from gpu_engine.api.protocol import (
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    StructuredOutput,
)
from tests.engine.structured_cases import (
    COMPILE_TIMEOUT_S,
    SCHEMAS,
    TOOL_PARAMETERS,
    check_every_schema,
    check_tool_call,
    structured_job,
    tool_job,
)

from .conftest import require_vllm


def _vllm(name: str, path) -> Engine:
    eng = Engine(
        batching=BatchingOptions(enabled=True, max_batch_size=24),
        drain_timeout_s=300,
        structured_timeout_s=COMPILE_TIMEOUT_S,
    )
    eng.load_model(
        LoadModelJob(
            name,
            str(path),
            dtype="float32",
            device="cpu",
            backend="vllm",
            options={"distributed_executor_backend": "uni", "max_num_seqs": 24},
        )
    )
    return eng


@pytest.fixture(scope="module")
def vllm_models(demo_assets, tools_model_dir):
    """One vLLM engine at a time (each holds its own KV cache): yields a function giving
    the engine for "demo" or "tools", loading it on first use."""
    require_vllm()
    paths = {
        "demo": ("smollm2-135m", demo_assets.models["smollm2-135m"].path),
        "tools": ("tiny-llama-tools", tools_model_dir),
    }
    current: dict[str, Engine] = {}

    def get(which: str) -> Engine:
        if which not in current:
            for eng in current.values():
                eng.shutdown()
            current.clear()
            current[which] = _vllm(*paths[which])
        return current[which]

    yield get
    for eng in current.values():
        eng.shutdown()


def test_every_schema_parses_and_validates(vllm_models):
    eng = vllm_models("demo")
    caps = eng.status().batching["capabilities"]
    assert caps["structured_output"] is True
    assert caps["tool_calling"] is False  # SmolLM2-135M-Instruct's template renders no tools
    check_every_schema(eng, timeout_s=300)
    # json_object; the grammar's end ends the request even under ignore_eos
    res = eng.generate_sync(
        structured_job("o", "a person with a name and an age", None, max_tokens=200, ignore_eos=True),
        timeout_s=300,
    )
    assert res.finish_reason == "stop", res.text
    assert isinstance(json.loads(res.text), dict)
    # positive control: unconstrained, the same prompt is not JSON
    free = GenerationJob(
        "free",
        messages=structured_job("f", "a person with a name and an age", None).messages,
        sampling=SamplingParams(max_tokens=30, temperature=0.0),
    )
    with pytest.raises(ValueError):
        json.loads(eng.generate_sync(free, timeout_s=300).text)


def test_a_grammar_masks_only_its_own_row_in_a_mixed_batch(vllm_models):
    eng = vllm_models("demo")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    jobs = {
        "plain": GenerationJob("plain", prompt="The weather today is", sampling=greedy),
        "plain-2": GenerationJob("plain-2", prompt="My favourite food is", sampling=greedy),
        "json": structured_job("json", "a task", SCHEMAS[13][1], max_tokens=80),
        "person": structured_job("person", "a person", SCHEMAS[0][1], max_tokens=80),
    }
    solo = {name: eng.generate_sync(job, timeout_s=300) for name, job in jobs.items()}
    # what vLLM runs: the requests each of its steps reports on
    llm = eng._scheduler.backend.engine
    seen: list[int] = []
    real = llm.step

    def spy():
        outputs = real()
        seen.append(len(outputs))
        return outputs

    llm.step = spy
    try:
        streams = {name: eng.generate(job) for name, job in jobs.items()}
        mixed = {name: s.result(timeout_s=300) for name, s in streams.items()}
    finally:
        del llm.step
    assert max(seen) == len(jobs)  # they shared vLLM's steps
    for name in jobs:
        assert mixed[name].token_ids == solo[name].token_ids, name
        assert mixed[name].finish_reason == solo[name].finish_reason, name
    for name, schema in (("json", SCHEMAS[13][1]), ("person", SCHEMAS[0][1])):
        assert mixed[name].finish_reason == "stop"
        jsonschema.validate(json.loads(mixed[name].text), schema)
    # positive control: without its grammar the structured prompt says something else
    free = GenerationJob(
        "free",
        messages=jobs["json"].messages,
        sampling=SamplingParams(max_tokens=80, temperature=0.0),
    )
    assert eng.generate_sync(free, timeout_s=300).token_ids != solo["json"].token_ids


def test_a_schema_the_compiler_refuses_is_response_format_unsupported(vllm_models):
    eng = vllm_models("demo")
    bad = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    job = GenerationJob("bad", prompt="x", sampling=SamplingParams(max_tokens=4, structured=bad))
    with pytest.raises(ResponseFormatUnsupported) as caught:
        eng.generate_sync(job, timeout_s=60)
    assert caught.value.details["param"] == "response_format"
    assert "ookbehind" in caught.value.message


@pytest.mark.parametrize(
    "functions",
    [list(TOOL_PARAMETERS), ["set_alarm"], ["ping"]],
    ids=["required", "named-set_alarm", "named-ping"],
)
def test_tool_choice_required_and_named_write_one_valid_call(vllm_models, functions):
    eng = vllm_models("tools")
    caps = eng.status().batching["capabilities"]
    assert (caps["tool_calling"], caps["tool_call_format"]) == (True, "hermes")
    res = eng.generate_sync(tool_job("call", functions), timeout_s=300)
    assert res.finish_reason == "stop", res.text
    check_tool_call(res.text, functions)
    res = eng.generate_sync(tool_job("call", functions, temperature=1.0, seed=11), timeout_s=300)
    assert res.finish_reason == "stop", res.text
    check_tool_call(res.text, functions)
