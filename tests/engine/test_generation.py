"""Serial generation: sampling, stop sequences, cancel, logprobs, usage, embeddings, scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_engine.api.errors import ContextLengthExceeded, InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    EmbedJob,
    FinishEvent,
    GenerationJob,
    GenerationResult,
    SamplingParams,
    ScoreJob,
    SteeringSpec,
    TokenEvent,
)

from .helpers import assert_prompt_alternatives, count_forwards, prompt_log_softmax
from .tolerances import EMBED_ATOL, LOGPROB_ATOL

PROMPT = "the sun rises over the hills and"


def sp(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def test_greedy_equals_hf_generate(engine):
    backend = engine.backend
    ids = backend.encode_text(PROMPT)
    out = engine.generate_sync(GenerationJob("g", prompt=PROMPT, sampling=sp(max_tokens=16)))
    with torch.inference_mode():
        ref = backend.model.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            do_sample=False,
            min_new_tokens=16,
            pad_token_id=backend.tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(ids),
        16,
        len(ids) + 16,
    )
    assert out.text == backend.tokenizer.decode(ref, skip_special_tokens=True) or out.text.endswith(
        backend.tokenizer.decode(ref, skip_special_tokens=True).strip()
    )


def test_stop_sequence_cuts_text_and_stops_generation_early(engine):
    base = engine.generate_sync(GenerationJob("b", prompt=PROMPT, sampling=sp(max_tokens=30)))
    # a stop string that first appears in the middle of the baseline text
    text = base.text
    start = len(text) // 3
    stop = text[start : start + 3]
    assert stop.strip(), "baseline text too uniform to pick a stop sequence"
    first = text.find(stop)
    with count_forwards(engine.backend.model) as n:
        out = engine.generate_sync(
            GenerationJob("s", prompt=PROMPT, sampling=sp(max_tokens=30, stop=[stop, "\x00never"]))
        )
    assert out.finish_reason == "stop"
    assert out.text == text[:first]
    assert stop not in out.text
    assert n[0] == out.forward_passes == len(out.token_ids) < 30
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    # streamed deltas add up to the same text and never leak the stop sequence
    deltas = "".join(
        e.text
        for e in engine.generate(GenerationJob("s2", prompt=PROMPT, sampling=sp(max_tokens=30, stop=[stop])))
        if isinstance(e, TokenEvent)
    )
    assert deltas == out.text


def test_eos_finishes_with_stop(engine):
    backend = engine.backend
    base = engine.generate_sync(GenerationJob("b", prompt=PROMPT, sampling=sp(max_tokens=8)))
    stop_id = base.token_ids[3]
    out = engine.generate_sync(GenerationJob("e", prompt=PROMPT, sampling=sp(max_tokens=8, stop_token_ids=[stop_id])))
    first = base.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    assert backend.eos_token_ids  # the model declares an EOS the loop honours by default


def test_seeded_sampling_is_reproducible_and_streaming_equals_non_streaming(engine):
    params = {
        "max_tokens": 20,
        "temperature": 1.3,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
    }
    a = engine.generate_sync(GenerationJob("a", prompt=PROMPT, sampling=sp(**params)))
    events = list(engine.generate(GenerationJob("b", prompt=PROMPT, sampling=sp(**params))))
    b = GenerationResult.from_events(events)
    c = engine.generate_sync(GenerationJob("c", prompt=PROMPT, sampling=sp(**{**params, "seed": 99})))
    assert a.token_ids == b.token_ids
    assert a.text == b.text == "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert c.token_ids != a.token_ids  # positive control: the seed matters


def test_delivered_events_equal_the_iterated_ones(engine):
    """``deliver_to`` (how an asyncio consumer takes events without a thread of its own):
    the same events in the same order as iterating, those produced before it first."""
    job = dict(prompt=PROMPT, sampling=sp(max_tokens=12, logprobs=True, top_logprobs=2))
    iterated = list(engine.generate(GenerationJob("it", **job)))
    stream = engine.generate(GenerationJob("push", **job))
    import threading
    import time

    got: list = []
    done = threading.Event()

    def deliver(event):
        got.append(event)
        if isinstance(event, FinishEvent):
            done.set()

    deadline = time.monotonic() + 30
    while stream._events.empty() and time.monotonic() < deadline:
        time.sleep(0.001)  # at least one event produced before delivery starts
    stream.deliver_to(deliver)
    assert done.wait(30)
    assert [type(e) for e in got] == [type(e) for e in iterated]
    assert [(e.token_id, e.text) for e in got if isinstance(e, TokenEvent)] == [
        (e.token_id, e.text) for e in iterated if isinstance(e, TokenEvent)
    ]
    assert got[-1].text == iterated[-1].text and got[-1].token_ids == iterated[-1].token_ids


def test_token_texts_come_from_the_engine_when_asked(engine, tiny_assets):
    """The prompt's text and each token's text, as the model's own tokenizer reads them
    (the web tier has no tokenizer)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_assets.models["tiny-llama"].path / "tokenizer.json"))
    events = list(engine.generate(GenerationJob("t", prompt=PROMPT, sampling=sp(max_tokens=5, token_texts=True))))
    finish = events[-1]
    assert events[0].prompt_text == finish.prompt_text == tok.decode(finish.prompt_token_ids, skip_special_tokens=False)
    assert finish.prompt_tokens == [tok.decode([t], skip_special_tokens=False) for t in finish.prompt_token_ids]
    assert finish.tokens == [tok.decode([t], skip_special_tokens=False) for t in finish.token_ids]
    plain = engine.generate_sync(GenerationJob("p", prompt=PROMPT, sampling=sp(max_tokens=5)))
    assert plain.token_ids == finish.token_ids  # asking for texts changes no token


def test_cancel_stops_within_one_step_and_frees_the_engine(engine):
    got = []
    with count_forwards(engine.backend.model) as n:
        stream = engine.generate(GenerationJob("long", prompt=PROMPT, sampling=sp(max_tokens=400)))
        for event in stream:
            got.append(event)
            if len(got) == 2:
                at_cancel = n[0]
                stream.cancel()
    finish = got[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "cancelled"
    # at most the forward pass already running when cancel() was called
    assert finish.forward_passes == n[0] <= at_cancel + 1 < 400
    assert len(finish.token_ids) == finish.forward_passes
    out = engine.generate_sync(GenerationJob("next", prompt=PROMPT, sampling=sp(max_tokens=3)), timeout_s=30)
    assert len(out.token_ids) == 3


def test_abandoning_the_iteration_cancels(engine):
    stream = engine.generate(GenerationJob("long", prompt=PROMPT, sampling=sp(max_tokens=400)))
    it = iter(stream)
    next(it)
    it.close()
    assert stream.cancelled
    assert engine.drain(timeout_s=30)


def test_context_length_error_reports_the_numbers(engine):
    n_prompt = len(engine.backend.encode_text(PROMPT))
    window = engine.backend.context_length
    with pytest.raises(ContextLengthExceeded) as err:
        engine.generate_sync(GenerationJob("c", prompt=PROMPT, sampling=sp(max_tokens=window)))
    assert err.value.details == {"prompt_tokens": n_prompt, "max_tokens": window, "context_length": window}
    # max_tokens=None fills the window
    out = engine.generate_sync(GenerationJob("f", prompt_token_ids=[5] * (window - 3), sampling=sp(max_tokens=None)))
    assert out.usage.total_tokens == window and out.finish_reason == "length"


def test_token_id_prompts_are_validated(engine):
    vocab = engine.backend.vocab_size
    with pytest.raises(InvalidParameter) as err:
        engine.generate_sync(GenerationJob("t", prompt_token_ids=[1, vocab], sampling=sp(max_tokens=2)))
    assert err.value.param == "prompt" and err.value.details["vocab_size"] == vocab
    ids = engine.backend.encode_text(PROMPT)
    by_ids = engine.generate_sync(GenerationJob("i", prompt_token_ids=ids, sampling=sp(max_tokens=6)))
    by_text = engine.generate_sync(GenerationJob("s", prompt=PROMPT, sampling=sp(max_tokens=6)))
    assert by_ids.token_ids == by_text.token_ids


def test_chat_messages_use_the_chat_template(engine):
    tok = engine.backend.tokenizer
    messages = [{"role": "user", "content": "hello there"}]
    expected = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    out = engine.generate_sync(GenerationJob("m", messages=messages, sampling=sp(max_tokens=3)))
    by_ids = engine.generate_sync(GenerationJob("i", prompt_token_ids=expected, sampling=sp(max_tokens=3)))
    assert out.usage.prompt_tokens == len(expected)
    assert out.token_ids == by_ids.token_ids


def test_logit_bias_is_added_to_the_logits_before_the_greedy_choice(engine):
    """Greedy with a bias equals the argmax of the model's own logits plus that bias,
    step by step (the reference runs the HF model itself, without the engine)."""
    ids = engine.backend.encode_text(PROMPT)
    plain = engine.generate_sync(GenerationJob("p", prompt_token_ids=ids, sampling=sp(max_tokens=8)))
    first = _own_logits(engine, ids)[-1]
    top2 = torch.topk(first, 2).indices.tolist()
    # just enough to lift the runner-up over the greedy token, and a ban on a later token
    bias = {top2[1]: float(first[top2[0]] - first[top2[1]]) + 0.25, plain.token_ids[3]: -100.0}
    out = engine.generate_sync(GenerationJob("b", prompt_token_ids=ids, sampling=sp(max_tokens=8, logit_bias=bias)))
    dense = torch.zeros(first.shape[-1], dtype=torch.float64)
    for t, b in bias.items():
        dense[t] = b
    ref = list(ids)
    for _ in range(8):
        ref.append(int(torch.argmax(_own_logits(engine, ref)[-1] + dense)))
    assert out.token_ids == ref[len(ids) :]
    assert out.token_ids != plain.token_ids and out.token_ids[0] == top2[1]
    vocab = engine.backend.vocab_size
    with pytest.raises(InvalidParameter) as err:
        engine.generate_sync(
            GenerationJob("v", prompt_token_ids=ids, sampling=sp(max_tokens=2, logit_bias={vocab: 1.0}))
        )
    assert err.value.param == "logit_bias" and err.value.details["vocab_size"] == vocab


def _own_logits(engine, ids):
    with torch.inference_mode():
        return engine.backend.model(torch.tensor([ids])).logits[0].double()


def test_logprobs_match_the_models_distribution(engine):
    ids = engine.backend.encode_text(PROMPT)
    out = engine.generate_sync(
        GenerationJob(
            "l", prompt_token_ids=ids, sampling=sp(max_tokens=5, logprobs=True, top_logprobs=3, prompt_logprobs=True)
        )
    )
    lsm = torch.log_softmax(_own_logits(engine, ids + out.token_ids), dim=-1).numpy()
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = lsm[len(ids) - 1 + i]
        assert lp.token_id == tok
        np.testing.assert_allclose(lp.logprob, row[tok], atol=LOGPROB_ATOL)
        top = np.argsort(-row)[:3]
        assert [e.token_id for e in lp.top_logprobs] == top.tolist()
        np.testing.assert_allclose([e.logprob for e in lp.top_logprobs], row[top], atol=LOGPROB_ATOL)
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(
        out.prompt_logprobs[1:], [lsm[j - 1][ids[j]] for j in range(1, len(ids))], atol=LOGPROB_ATOL
    )


def test_prompt_alternatives_are_the_prefills_top_k(engine):
    """echo + logprobs >= 1: every prompt position's top-k from the one prefill, equal to a
    plain forward's log_softmax."""
    ids = engine.backend.encode_text(PROMPT)
    with count_forwards(engine.backend.model) as n:
        out = engine.generate_sync(
            GenerationJob(
                "p", prompt_token_ids=ids, sampling=sp(max_tokens=1, prompt_logprobs=True, prompt_top_logprobs=4)
            )
        )
    assert n[0] == out.forward_passes == 1  # one forward, whatever the prompt's length
    assert_prompt_alternatives(out, prompt_log_softmax(engine, ids), ids, 4, LOGPROB_ATOL)
    assert out.prompt_top_logprobs[1][0].token == engine.backend.tokenizer.decode(
        [out.prompt_top_logprobs[1][0].token_id]
    )
    plain = engine.generate_sync(
        GenerationJob("q", prompt_token_ids=ids, sampling=sp(max_tokens=1, prompt_logprobs=True))
    )
    assert plain.prompt_top_logprobs is None and plain.prompt_logprobs == out.prompt_logprobs
    with pytest.raises(InvalidParameter) as err:
        sp(max_tokens=1, prompt_top_logprobs=2)
    assert err.value.param == "prompt_top_logprobs"


def test_score_next_token_logprobs(engine):
    ids = engine.backend.encode_text(PROMPT)
    lsm = torch.log_softmax(_own_logits(engine, ids)[-1], dim=-1).numpy()
    res = engine.score(ScoreJob("s", prompt_token_ids=ids, top_k=4, prompt_logprobs=True))
    assert [e.token_id for e in res.top] == np.argsort(-lsm)[:4].tolist()
    np.testing.assert_allclose([e.logprob for e in res.top], np.sort(lsm)[::-1][:4], atol=LOGPROB_ATOL)
    allowed = engine.score(ScoreJob("a", prompt=PROMPT, allowed_token_ids=[7, 11, 13]))
    np.testing.assert_allclose([e.logprob for e in allowed.allowed], lsm[[7, 11, 13]], atol=LOGPROB_ATOL)
    assert len(res.prompt_logprobs) == len(ids)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_pool_the_last_hidden_state(engine, pooling, normalize):
    ids = engine.backend.encode_text(PROMPT)
    with torch.inference_mode():
        hs = engine.backend.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    vec = {"mean": hs.mean(axis=0), "last": hs[-1], "cls": hs[0]}[pooling]
    if normalize:
        vec = vec / np.linalg.norm(vec)
    res = engine.embed(EmbedJob("e", [PROMPT, ids], pooling=pooling, normalize=normalize))
    assert res.usage.prompt_tokens == 2 * len(ids)
    for emb in res.embeddings:
        np.testing.assert_allclose(emb, vec, atol=EMBED_ATOL)


def test_embeddings_and_scores_are_never_steered(engine, tiny_assets):
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    before_e = engine.embed(EmbedJob("e", [PROMPT])).embeddings
    before_s = engine.score(ScoreJob("s", prompt=PROMPT, top_k=3)).top
    engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    # a steered generation runs concurrently with the embedding/score requests
    steered = engine.generate(
        GenerationJob(
            "g",
            prompt=PROMPT,
            sampling=sp(max_tokens=20),
            steering=SteeringSpec.from_mapping({(asset.name, 1): {3: 50.0}}),
        )
    )
    assert engine.embed(EmbedJob("e", [PROMPT])).embeddings == before_e
    assert engine.score(ScoreJob("s", prompt=PROMPT, top_k=3)).top == before_s
    steered.result(timeout_s=60)
    assert engine.attachments()[0].steering_apply_count == 20
