"""Chat and text completions through the official client over a real socket, compared
with independent references: the engine called directly with the same job, and Hugging
Face transformers' own greedy decoding."""

from __future__ import annotations

import json

import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams
from tests.v1.helpers import request

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the sea and the sky."},
]


def _direct(server, **job):
    return server.engine.generate_sync(GenerationJob(request_id="ref", **job), timeout_s=60)


def test_chat_equals_direct_engine_call_with_the_same_seed(llama, openai_client):
    out = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        presence_penalty=0.5,
    )
    ref = _direct(
        llama,
        messages=MESSAGES,
        sampling=SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.5),
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == ref.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == ref.usage.total_tokens
    assert out.model == "tiny-llama" and out.object == "chat.completion"
    # positive control: another seed gives another text
    other = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=24, temperature=0.9, top_p=0.95, seed=99, presence_penalty=0.5
    )
    assert other.choices[0].message.content != ref.text


def test_the_seed_header_says_its_scope_and_the_choices_follow_it(llama, openai_client):
    kw = dict(model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=1.0)
    raw = openai_client.chat.completions.with_raw_response.create(seed=7, n=2, **kw)
    assert raw.headers["x-millm-seed"] == "7;scope=request;choices=2"
    got = [c.message.content for c in raw.parse().choices]
    # choice i drew from seed + i, as the header says
    assert got == [
        _direct(llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i)).text
        for i in range(2)
    ]
    one = openai_client.chat.completions.with_raw_response.create(seed=7, **kw)
    assert one.headers["x-millm-seed"] == "7;scope=request"
    assert "x-millm-seed" not in openai_client.chat.completions.with_raw_response.create(**kw).headers


def test_greedy_chat_matches_transformers_generate(llama, openai_client, tiny_assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_assets.models["tiny-llama"].path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        gen = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=tok.pad_token_id)
    expected_ids = gen[0, ids.shape[1] :].tolist()
    out = openai_client.completions.create(
        model="tiny-llama", prompt=ids[0].tolist(), max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    decoded = tok.decode(expected_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert out.choices[0].text == decoded
    assert out.usage.completion_tokens == 20
    chat = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=20, temperature=0)
    eos = {tok.convert_tokens_to_ids("</s>"), tok.convert_tokens_to_ids("<|im_end|>")}
    cut = next((i for i, t in enumerate(expected_ids) if t in eos), len(expected_ids))
    assert chat.choices[0].message.content == tok.decode(
        expected_ids[:cut], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert chat.usage.completion_tokens == min(cut + 1, 20)


def test_stream_concatenates_to_the_plain_response(llama, openai_client):
    kwargs = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 30, "temperature": 1.0, "seed": 7}
    plain = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == plain.choices[0].finish_reason and set(reasons[:-1]) == {None}
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing(llama):
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 5, "stream": True},
    )
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-millm-steering"] == "none"
    assert resp.headers["x-millm-backend"] == "transformers"
    events = resp.events()
    assert events[-1] == "[DONE]"
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in events[0]  # only when asked
    assert resp.body.endswith(b"data: [DONE]\n\n")


def test_stop_sequences_and_n_choices(llama, openai_client):
    base = openai_client.completions.create(
        model="tiny-llama", prompt="the sea", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = openai_client.completions.create(
        model="tiny-llama", prompt="the sea", max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    many = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=12, n=3, seed=5, temperature=1
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) > 1
    refs = [
        _direct(llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=12, temperature=1, seed=5 + i)).text
        for i in range(3)
    ]
    assert [c.message.content for c in many.choices] == refs
    assert many.usage.completion_tokens == sum(
        len(
            _direct(
                llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=12, temperature=1, seed=5 + i)
            ).token_ids
        )
        for i in range(3)
    )


def test_chat_logprobs(llama, openai_client):
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    ref = _direct(
        llama, messages=MESSAGES, sampling=SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    )
    assert [c.token for c in content] == [lp.token for lp in ref.logprobs]
    for got, exp in zip(content, ref.logprobs):
        assert got.logprob == pytest.approx(exp.logprob, abs=1e-6)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob == pytest.approx(exp.logprob, abs=1e-6)  # greedy


def test_completions_prompt_forms(llama, openai_client):
    out = openai_client.completions.create(
        model="tiny-llama", prompt=["the sea", "a sky"], max_tokens=8, temperature=0.7, seed=3, n=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(["the sea", "a sky"]):
        for i in range(2):
            ref = _direct(llama, prompt=prompt, sampling=SamplingParams(max_tokens=8, temperature=0.7, seed=3 + i))
            assert out.choices[p * 2 + i].text == ref.text
    prompt_ids = _direct(llama, prompt="the sea", sampling=SamplingParams(max_tokens=1))
    ids = llama.engine.backend.encode_text("the sea")
    by_ids = openai_client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0)
    by_text = openai_client.completions.create(model="tiny-llama", prompt="the sea", max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == prompt_ids.usage.prompt_tokens
    echoed = openai_client.completions.create(
        model="tiny-llama", prompt="the sea", max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "the sea" + by_text.choices[0].text


def test_streaming_completions(llama, openai_client):
    kwargs = {"model": "tiny-llama", "prompt": "the sky", "max_tokens": 20, "temperature": 1, "seed": 11}
    plain = openai_client.completions.create(**kwargs)
    chunks = list(openai_client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_echo_logprobs_equal_the_engine_prompt_scores(llama, openai_client):
    from gpu_engine.api.protocol import ScoreJob

    out = openai_client.completions.create(
        model="tiny-llama", prompt="the sea is wide", max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    lp = out.choices[0].logprobs
    score = llama.engine.score(ScoreJob("s", prompt="the sea is wide", prompt_logprobs=True, top_k=2))
    n_prompt = score.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(score.prompt_logprobs[1:], abs=1e-5)
    # the alternatives after the whole prompt are the engine's next-token top-2
    last = lp.top_logprobs[n_prompt]
    for entry in score.top:
        assert last[entry.token] == pytest.approx(entry.logprob, abs=1e-5)
    assert len(lp.tokens) == n_prompt + 1
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(llama, openai_client):
    """OpenAI's minimum 0 on completions: with echo the classic scoring call — the prompt
    back with its logprobs, no completion token, completion_tokens 0, finish "length" —
    streamed or not; the prompt logprobs equal the engine's own scoring."""
    from gpu_engine.api.protocol import ScoreJob

    prompt = "the sea is wide"
    score = llama.engine.score(ScoreJob("s", prompt=prompt, prompt_logprobs=True))
    out = openai_client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        score.prompt_tokens,
        0,
        score.prompt_tokens,
    )
    assert len(choice.logprobs.tokens) == score.prompt_tokens  # the prompt's, nothing more
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(score.prompt_logprobs[1:], abs=1e-5)
    bare = openai_client.completions.create(model="tiny-llama", prompt=[prompt, "a sky"], max_tokens=0, logprobs=2)
    assert [(c.text, c.finish_reason, c.logprobs.tokens) for c in bare.choices] == [("", "length", [])] * 2
    assert bare.usage.completion_tokens == 0
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=0,
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    assert chunks[-1].usage.prompt_tokens == score.prompt_tokens
    refused = request(
        llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": -1}
    )
    assert refused.status == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_streamed_logprobs_carry_the_running_text_offset(llama, openai_client):
    kwargs = {
        "model": "tiny-llama",
        "prompt": "the sky",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    plain = openai_client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(openai_client.completions.create(**kwargs, stream=True))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    # each token's offset is the length of the token texts before it
    want = [sum(len(t) for t in plain.tokens[:i]) for i in range(len(plain.tokens))]
    assert offsets == plain.text_offset == want
    assert len(set(offsets)) == len(offsets) > 1


def test_usage_is_the_last_chunk_after_the_millm_chunk(llama):
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": "the sky",
            "max_tokens": 4,
            "ignore_eos": True,  # sampled: an EOS would end it before its fourth token
            "stream": True,
            "stream_options": {"include_usage": True},
            "steering": {"features": []},
        },
    )
    events = resp.events()
    assert events[-1] == "[DONE]"
    last, before = events[-2], events[:-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in before)  # null on every other chunk
    millm = [e for e in before if "millm" in e and e["millm"] is not None]
    assert len(millm) == 1 and millm[0] is before[-1]


def test_a_streamed_n_request_keeps_every_choice_through_an_unload(llama):
    """Every choice of a stream reaches the engine with the first, so an unload asked while
    choice 0 streams waits for all of them (GRACEFUL_UNLOAD_TIMEOUT); submitted only when
    its turn came, choice 1 was new work and the client got a model_busy frame."""
    import threading
    import time

    from tests.v1.helpers import open_stream

    layer = llama.engine.backend.model.get_submodule("model.layers.0")
    hook = layer.register_forward_hook(lambda *args: time.sleep(0.02))  # known lengths
    try:
        sock, received = open_stream(
            llama.url,
            "/v1/completions",
            {"model": "tiny-llama", "prompt": "Once upon", "max_tokens": 12, "n": 3, "temperature": 0, "stream": True},
        )
        unloaded = threading.Event()
        threading.Thread(target=lambda: (llama.engine.unload_model(timeout_s=30), unloaded.set()), daemon=True).start()
        while b"data: [DONE]" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        sock.close()
    finally:
        hook.remove()
    assert unloaded.wait(30)
    frames = [
        json.loads(line[6:]) for line in received.decode(errors="replace").split("\n") if line.startswith("data: {")
    ]
    assert not [f for f in frames if "error" in f], frames[-1]
    finished = {c["index"]: c["finish_reason"] for f in frames for c in f.get("choices", []) if c.get("finish_reason")}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_stop_token_ids_end_the_generation_like_eos(llama):
    """vLLM's stop_token_ids (docs/api-v1.md): the greedy run's third token, named, ends a
    second run there with finish_reason stop; the field is read, not listed as ignored."""
    body = {"model": "tiny-llama", "prompt": "Once upon", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reference = llama.engine.generate_sync(
        GenerationJob(
            "ref", prompt="Once upon", sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
    )
    stop_at = reference.token_ids[2]
    if stop_at in reference.token_ids[:2]:
        pytest.skip("the tiny model repeats its token; pick another prompt")
    resp = request(llama.url, "POST", "/v1/completions", {**body, "stop_token_ids": [stop_at]})
    assert resp.status == 200, resp.body
    data = resp.json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == 3
    assert "x-millm-ignored-fields" not in resp.headers
    plain = request(llama.url, "POST", "/v1/completions", body).json()
    assert plain["choices"][0]["finish_reason"] == "length"
    assert plain["choices"][0]["text"].startswith(data["choices"][0]["text"])


def test_echoed_text_offsets_index_the_text_the_answer_returns(llama):
    """OpenAI's text_offset indexes the choice's text; the echoed prompt's BOS (<s>) is not
    in that text, so it takes no room (the offsets were shifted by its length)."""
    resp = request(
        llama.url,
        "POST",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "The cat", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
    )
    choice = resp.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert lp["tokens"][0] == "<s>" and not text.startswith("<s>")  # what this is about
    placed = [(tok, off) for tok, off in zip(lp["tokens"], lp["text_offset"]) if tok != "<s>"]
    assert all(text[off : off + len(tok)] == tok for tok, off in placed), (text, placed)
    assert lp["text_offset"] == sorted(lp["text_offset"])
