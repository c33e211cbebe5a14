"""Structured output and tool calls on the llama.cpp backend: xgrammar masks over the GGUF's
own vocabulary, in our batched runner, on each request's own row.

The schemas run on the demo SmolLM2-135M GGUF (Q4_1), as the transformers backend's run on
its checkpoint (a random tiny model writes digits until ``max_tokens`` wherever a number is
unbounded).  Tool calls run on tiny-llama-tools (``<tool_call>`` as single tokens, a Hermes
template that renders tools) as a float32 GGUF: its weights are random, so only the grammar
makes its calls valid.  ``jsonschema`` checks every output, never the grammar that made it.
"""

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
from offline_assets import demo_gguf_path
from tests.engine.structured_cases import (
    COMPILE_TIMEOUT_S,
    SCHEMAS,
    TOOL_PARAMETERS,
    check_every_schema,
    check_tool_call,
    structured_job,
    tool_job,
)


def gguf_job(path, name="tiny-llama-tools") -> LoadModelJob:
    # a 1,024-token window: the KV cache holds one window per batch row; the tiny float32
    # model keeps a float32 cache without flash attention (a batch row computes exactly
    # its solo run, as in test_llamacpp), the demo a float16 one
    tiny = name == "tiny-llama-tools"
    return LoadModelJob(
        name,
        str(path),
        device="cpu",
        backend="llamacpp",
        max_context_length=1024,
        options={"kv_cache_type": "f32" if tiny else "f16", "flash_attention": not tiny},
    )


@pytest.fixture(scope="module")
def gguf_demo(demo_assets, llamacpp):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=24), structured_timeout_s=COMPILE_TIMEOUT_S)
    eng.load_model(gguf_job(demo_gguf_path(), "smollm2-gguf"))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def gguf_tools(tools_gguf):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=24), structured_timeout_s=COMPILE_TIMEOUT_S)
    eng.load_model(gguf_job(tools_gguf))
    yield eng
    eng.shutdown()


def test_capabilities_say_structured_output_and_tools(gguf_tools, tiny_gguf):
    caps = gguf_tools.status().batching["capabilities"]
    assert caps["structured_output"] is True
    assert (caps["tool_calling"], caps["tool_call_format"]) == (True, "hermes")
    # tiny-llama's own ChatML template ignores tools: no tool calling there
    plain = Engine(structured_timeout_s=COMPILE_TIMEOUT_S)
    try:
        plain.load_model(gguf_job(tiny_gguf))
        caps = plain.status().batching["capabilities"]
        assert caps["structured_output"] is True and caps["tool_calling"] is False
    finally:
        plain.shutdown()


def _hf_reading(tokenizer, vocab_size: int) -> list[bytes]:
    """What the grammar should see for each token: xgrammar's reading of the checkpoint's
    own tokenizer, with its special tokens never text."""
    import xgrammar as xg

    ref = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    # the tokens its decode drops under skip_special_tokens, as the engine decodes text
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    decoded = ref.decoded_vocab  # built anew at each read
    return [b"" if i in special else decoded[i] for i in range(vocab_size)]


def test_the_grammar_reads_the_vocabulary_as_the_tokenizer_writes_it(
    gguf_tools, tools_model_dir, gguf_demo, demo_assets
):
    """Every token the GGUF can write in text decodes, for the grammar, to the bytes the
    checkpoint's own tokenizer gives it; control tokens are never text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tools_model_dir))
    info = gguf_tools.backend.structured_grammars().info
    assert info.vocab_size == len(tok) == 514
    decoded = info.decoded_vocab
    assert decoded == _hf_reading(tok, len(tok))
    assert decoded[512] == b"<tool_call>"
    assert set(info.stop_token_ids) == gguf_tools.backend.eos_token_ids
    # the real SmolLM2 GGUF against its checkpoint's tokenizer
    tok = AutoTokenizer.from_pretrained(str(demo_assets.models["smollm2-135m"].path))
    info = gguf_demo.backend.structured_grammars().info
    assert info.decoded_vocab == _hf_reading(tok, len(tok))


def test_every_schema_parses_and_validates(gguf_demo):
    check_every_schema(gguf_demo, timeout_s=240)
    res = gguf_demo.generate_sync(
        structured_job("o", "a person with a name and an age", None, max_tokens=200), timeout_s=240
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
        json.loads(gguf_demo.generate_sync(free, timeout_s=60).text)


@pytest.mark.parametrize(
    "functions",
    [list(TOOL_PARAMETERS), ["set_alarm"], ["ping"]],
    ids=["required", "named-set_alarm", "named-ping"],
)
def test_tool_choice_required_and_named_write_one_valid_call(gguf_tools, functions):
    res = gguf_tools.generate_sync(tool_job("call", functions), timeout_s=240)
    assert res.finish_reason == "stop", res.text
    check_tool_call(res.text, functions)
    # sampled too
    res = gguf_tools.generate_sync(tool_job("call", functions, temperature=1.0, seed=11), timeout_s=240)
    assert res.finish_reason == "stop", res.text
    check_tool_call(res.text, functions)


def test_a_grammar_masks_only_its_own_row_in_a_mixed_batch(gguf_tools):
    """On the float32 tiny model (SmolLM2's Q4_1 kernels give a batch row last-bit
    differences from its solo run whatever the grammar does), bounded schemas and a call."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    jobs = {
        "plain": GenerationJob("plain", prompt="The weather today is", sampling=greedy),
        "sampled-plain": GenerationJob(
            "sampled-plain",
            prompt="One two three",
            sampling=SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
        ),
        "json": structured_job("json", "a task", SCHEMAS[13][1], max_tokens=120),
        "sampled-json": structured_job(
            "sampled-json", "a matrix", SCHEMAS[19][1], max_tokens=120, temperature=0.9, seed=7
        ),
        "call": tool_job("call", ["get_weather"]),
    }
    solo = {name: gguf_tools.generate_sync(job, timeout_s=240) for name, job in jobs.items()}
    # what llama.cpp decodes: the sequences in each llama_decode
    ctx = gguf_tools.backend.context
    seen: list[int] = []
    real = ctx.decode

    def spy(tokens):
        seen.append(len({t[2] for t in tokens}))
        return real(tokens)

    ctx.decode = spy
    try:
        streams = {name: gguf_tools.generate(job) for name, job in jobs.items()}
        mixed = {name: s.result(timeout_s=240) for name, s in streams.items()}
    finally:
        del ctx.decode
    assert max(seen) == len(jobs)  # they shared forward passes
    for name in jobs:
        assert mixed[name].token_ids == solo[name].token_ids, name
        assert mixed[name].finish_reason == solo[name].finish_reason, name
    for name, schema in (("json", SCHEMAS[13][1]), ("sampled-json", SCHEMAS[19][1])):
        assert mixed[name].finish_reason == "stop"
        jsonschema.validate(json.loads(mixed[name].text), schema)
    check_tool_call(mixed["call"].text, ["get_weather"])
    # positive control: without its grammar the structured prompt says something else
    free = GenerationJob(
        "free",
        messages=jobs["json"].messages,
        sampling=SamplingParams(max_tokens=80, temperature=0.0),
    )
    assert gguf_tools.generate_sync(free, timeout_s=240).token_ids != solo["json"].token_ids


def test_the_serial_path_masks_the_same(demo_assets, llamacpp):
    eng = Engine(structured_timeout_s=COMPILE_TIMEOUT_S)
    eng.load_model(gguf_job(demo_gguf_path(), "smollm2-gguf"))
    try:
        what, schema = SCHEMAS[8]
        res = eng.generate_sync(structured_job("serial", what, schema), timeout_s=240)
        assert res.finish_reason == "stop", res.text
        jsonschema.validate(json.loads(res.text), schema)
    finally:
        eng.shutdown()


def test_a_schema_the_compiler_refuses_is_response_format_unsupported(gguf_tools):
    bad = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    job = GenerationJob("bad", prompt="x", sampling=SamplingParams(max_tokens=4, structured=bad))
    with pytest.raises(ResponseFormatUnsupported) as caught:
        gguf_tools.generate_sync(job, timeout_s=60)
    assert caught.value.details["param"] == "response_format"
    assert "ookbehind" in caught.value.message
