"""Every command of the engine protocol (``gpu_engine.api.commands.COMMANDS``), through both
transports — the engine in this process and the engine behind a real redis-server — with
a real engine on the tiny Llama: what the caller sees is right, and the same both ways.

Expectations come from outside the engine: greedy tokens and the next-token distribution
from transformers itself, sizes from the asset manifest."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import redis
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.engine_client import EmbeddedEngineClient, EngineClient
from gpu_engine.api.commands import COMMANDS, check_implements
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import (
    EngineBusy,
    InvalidParameter,
    ResponseFormatUnsupported,
    SAENotAttached,
    UnsupportedQuantization,
)
from gpu_engine.api.monitoring import unpack
from gpu_engine.api.protocol import (
    AttachSpec,
    EmbedJob,
    ErrorEvent,
    AttributionJob,
    FeatureLogitsJob,
    GenerationJob,
    HiddenStatesJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    ScoreJob,
    StructuredOutput,
    TokenEvent,
    TokenizeJob,
    from_json,
)
from gpu_engine.api.transport import Envelope, Keys, decode_event
from tests.distributed.fakes import FakeEngine, running_server
from tests.distributed.test_transport import make_client
from tests.engine.helpers import RefSAE
from tests.engine.tolerances import ENCODE_ATOL, ENCODE_RTOL

PROMPT_IDS = [5, 17, 42, 9, 33, 8]
NEW_TOKENS = 8
TEXTS = ["The cat sat on the mat.", "héllo  wörld\n", "a"]
LOGIT_FEATURES = [0, 5, 17]
TOP_N = 4


@pytest.fixture(scope="module")
def reference(tiny_assets) -> dict[str, Any]:
    """Greedy tokens and next-token log-probabilities of PROMPT_IDS, from transformers."""
    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), torch_dtype=torch.float32)
    model.eval()
    ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        greedy = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(PROMPT_IDS) :].tolist()
        out = model(ids, output_hidden_states=True)
        logprobs = torch.log_softmax(out.logits[0, -1].double(), -1)
    top = torch.topk(logprobs, 3)
    # block 1's output at the last token (hidden_states[L + 1] is block L's output)
    return {
        "greedy": greedy,
        "top_ids": top.indices.tolist(),
        "top_logprobs": top.values.tolist(),
        "hidden_l1_last": out.hidden_states[2][0, -1].tolist(),
        # block 1's output at every prompt position, float64, for the packed monitor
        "hidden_l1": out.hidden_states[2][0].double().numpy(),
        "tokenized": [
            AutoTokenizer.from_pretrained(str(asset.path))(t, add_special_tokens=False)["input_ids"] for t in TEXTS
        ],
    }


@contextmanager
def embedded(url: str, prefix: str) -> Iterator[EngineClient]:
    client = EmbeddedEngineClient(drain_timeout_s=30)
    try:
        yield client
    finally:
        client.shutdown()


@contextmanager
def over_redis(url: str, prefix: str) -> Iterator[EngineClient]:
    engine = Engine(drain_timeout_s=30)
    try:
        with running_server(url, engine, prefix):
            client = make_client(url, prefix)
            try:
                yield client
            finally:
                client.shutdown()
    finally:
        engine.shutdown()


def _long_generation(client: EngineClient, rid: str) -> Iterator[Any]:
    """A greedy generation far longer than the test lets it run; its first token seen."""
    job = GenerationJob(
        rid, prompt_token_ids=PROMPT_IDS, sampling=SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    )
    events = client.generate(job).events(30)
    assert isinstance(next(events), TokenEvent)
    return events


# One step per command, in an order that makes each meaningful; each returns what the
# caller saw (compared across transports) after asserting it against the reference.
Step = Callable[[EngineClient, Any, dict[str, Any]], Any]


def step_status(client, assets, ref):
    status = client.status()
    assert (status.state, status.model_id, status.attachments) == ("empty", None, [])
    return status.state


def step_check_load(client, assets, ref):
    model = assets.models["tiny-llama"]
    fine = client.check_load(
        LoadModelJob("tiny-llama", str(model.path), dtype="float32", device="cpu", options={"quantization": "Q8"})
    )
    with pytest.raises(UnsupportedQuantization) as refused:
        client.check_load(
            LoadModelJob("tiny-llama", str(model.path), dtype="float32", device="cpu", options={"quantization": "Q2"})
        )
    assert refused.value.details["quantization"] == "Q2"
    assert client.status().state == "empty"  # a check loads nothing
    return [fine, refused.value.code]


def step_load_model(client, assets, ref):
    model = assets.models["tiny-llama"]
    status = client.load_model(LoadModelJob("tiny-llama", str(model.path), dtype="float32", device="cpu"))
    assert (status.state, status.model_id) == ("ready", "tiny-llama")
    assert (status.num_layers, status.hidden_size, status.vocab_size) == (
        model.num_layers,
        model.hidden_size,
        model.vocab_size,
    )
    assert client.status().model_id == "tiny-llama"
    return [status.state, status.num_layers, status.hidden_size, status.vocab_size]


def step_check_sae(client, assets, ref):
    sae = assets.saes["tiny-llama-L1-relu"]
    fits = client.check_sae(str(sae.path), 1)
    beyond = client.check_sae(str(sae.path), 99)
    assert fits.compatible and not fits.errors
    assert not beyond.compatible and beyond.errors
    return [fits.compatible, beyond.compatible, len(beyond.errors)]


def step_attach_set(client, assets, ref):
    sae = assets.saes["tiny-llama-L1-relu"]
    [result] = client.attach_set([AttachSpec("sae_t", str(sae.path), 1)])
    assert (result.sae_id, result.layer, result.layer_module_path) == (
        "sae_t",
        1,
        assets.models["tiny-llama"].layer_module_path(1),
    )
    assert (result.d_in, result.d_sae) == (sae.d_in, sae.d_sae)
    assert [(a.sae_id, a.layer) for a in client.attachments()] == [("sae_t", 1)]
    return [result.layer_module_path, result.d_in, result.d_sae]


def step_generate(client, assets, ref):
    job = GenerationJob(
        f"gen-{secrets.token_hex(4)}",
        prompt_token_ids=PROMPT_IDS,
        sampling=SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
    )
    events = list(client.generate(job).events(30))
    finish = events[-1]
    assert [type(e).__name__ for e in events] == ["TokenEvent"] * NEW_TOKENS + ["FinishEvent"]
    assert [e.token_id for e in events[:-1]] == finish.token_ids == ref["greedy"]
    assert (finish.finish_reason, finish.usage.prompt_tokens, finish.usage.completion_tokens) == (
        "length",
        len(PROMPT_IDS),
        NEW_TOKENS,
    )
    # a packed monitor: every non-zero feature of every prompt row, as CSR bytes that
    # survive the transport, equal to the test's own float64 encode of block 1's output
    sae = RefSAE(assets.saes["tiny-llama-L1-relu"])
    packed = GenerationJob(
        f"gen-{secrets.token_hex(4)}",
        prompt_token_ids=PROMPT_IDS,
        sampling=SamplingParams(max_tokens=1, temperature=0),
        monitor=MonitorSpec([MonitorEntry("sae_t", 1, packed=True, positions="prompt")]),
    )
    [record] = list(client.generate(packed).events(30))[-1].activations
    assert (record.position, record.packed.rows, record.top_k, record.features) == (0, len(PROMPT_IDS), [], [])
    row_ptr, indices, values = unpack(record.packed)
    dense = np.zeros((len(PROMPT_IDS), sae.W_enc.shape[1]))
    for r in range(len(PROMPT_IDS)):
        cols = indices[row_ptr[r] : row_ptr[r + 1]]
        assert (np.diff(cols) > 0).all()
        dense[r, cols] = values[row_ptr[r] : row_ptr[r + 1]]
    want = sae.encode(ref["hidden_l1"])
    assert (want > 0).sum() > len(PROMPT_IDS)  # features fire: the comparison is not of zeros
    np.testing.assert_allclose(dense, want, atol=ENCODE_ATOL, rtol=ENCODE_RTOL)
    return [finish.token_ids, finish.text, row_ptr.tolist(), indices.tolist()]


def step_embed(client, assets, ref):
    hidden = assets.models["tiny-llama"].hidden_size
    result = client.embed(EmbedJob(f"emb-{secrets.token_hex(4)}", [PROMPT_IDS, PROMPT_IDS[:3]]))
    assert [len(v) for v in result.embeddings] == [hidden, hidden]
    for vector in result.embeddings:  # normalize=True
        assert sum(x * x for x in vector) == pytest.approx(1.0, abs=1e-5)
    assert result.usage.prompt_tokens == len(PROMPT_IDS) + 3
    return result.embeddings


def step_score(client, assets, ref):
    result = client.score(ScoreJob(f"score-{secrets.token_hex(4)}", prompt_token_ids=PROMPT_IDS, top_k=3))
    assert [e.token_id for e in result.top] == ref["top_ids"]
    assert [e.logprob for e in result.top] == pytest.approx(ref["top_logprobs"], abs=1e-4)
    return [[e.token_id, round(e.logprob, 4)] for e in result.top]


def step_hidden_states(client, assets, ref):
    result = client.hidden_states(
        HiddenStatesJob(f"hs-{secrets.token_hex(4)}", [PROMPT_IDS], layers=[1], pooling="last")
    )
    assert result.layers == [1] and result.usage.prompt_tokens == len(PROMPT_IDS)
    assert result.states[0][0] == pytest.approx(ref["hidden_l1_last"], abs=1e-5)
    return [round(x, 4) for x in result.states[0][0]]


def step_tokenize(client, assets, ref):
    result = client.tokenize(TokenizeJob(f"tok-{secrets.token_hex(4)}", TEXTS))
    assert result.token_ids == ref["tokenized"]
    return result.token_ids


def step_feature_logits(client, assets, ref):
    """Each feature's W_dec[i] @ W_U.T (the test's own float64 product of the files'
    tensors): its top and bottom tokens, and a layer the SAE is not attached at refused."""
    sae = assets.saes["tiny-llama-L1-relu"]
    w_dec = load_file(str(sae.path / "sae_weights.safetensors"))["W_dec"].astype(np.float64)
    weights = load_file(str(assets.models["tiny-llama"].path / "model.safetensors"))
    w_u = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).astype(np.float64)
    result = client.feature_logits(
        FeatureLogitsJob(f"fl-{secrets.token_hex(4)}", "sae_t", 1, features=LOGIT_FEATURES, top_n=TOP_N)
    )
    assert result.features == LOGIT_FEATURES
    tok = AutoTokenizer.from_pretrained(str(assets.models["tiny-llama"].path))
    for j, f in enumerate(LOGIT_FEATURES):
        logits = w_dec[f] @ w_u.T
        order = np.argsort(logits)
        assert result.top_values[j] == pytest.approx(logits[order[::-1][:TOP_N]].tolist(), abs=1e-4)
        assert result.bottom_values[j] == pytest.approx(logits[order[:TOP_N]].tolist(), abs=1e-4)
        # the ids named carry those values (a tie may order two ids either way)
        assert result.top_values[j] == pytest.approx(logits[result.top_ids[j]].tolist(), abs=1e-4)
        assert result.bottom_values[j] == pytest.approx(logits[result.bottom_ids[j]].tolist(), abs=1e-4)
        assert result.top_tokens[j] == [tok.decode([i]) for i in result.top_ids[j]]
        assert result.bottom_tokens[j] == [tok.decode([i]) for i in result.bottom_ids[j]]
    with pytest.raises(SAENotAttached):
        client.feature_logits(FeatureLogitsJob(f"fl-{secrets.token_hex(4)}", "sae_t", 2))
    return [result.top_ids, result.bottom_ids, result.top_tokens]


def step_attribution(client, assets, ref):
    """The greedy next token's logit attributed to the SAE's features: the packed rows name
    exactly the features the test's own float64 encode of block 1's output activates, the
    ablation check comes back for the first two; an SAE not attached there and a target
    past the vocabulary are refused (tests/engine/test_attribution.py checks the values
    against finite differences)."""
    result = client.attribution(
        AttributionJob(f"attr-{secrets.token_hex(4)}", "sae_t", 1, prompt_token_ids=PROMPT_IDS, top_n=4, ablate_top=2)
    )
    assert result.prompt_token_ids == PROMPT_IDS and result.target_token_id == ref["greedy"][0]
    acts = RefSAE(assets.saes["tiny-llama-L1-relu"]).encode(ref["hidden_l1"])
    row_ptr, indices, values = unpack(result.attributions)
    for r in range(len(PROMPT_IDS)):
        assert indices[row_ptr[r] : row_ptr[r + 1]].tolist() == np.flatnonzero(acts[r] > 0).tolist()
    assert len(result.top) == 4 and [f.ablation_delta is None for f in result.top] == [False, False, True, True]
    with pytest.raises(SAENotAttached):
        client.attribution(AttributionJob(f"attr-{secrets.token_hex(4)}", "sae_t", 2, prompt_token_ids=PROMPT_IDS))
    with pytest.raises(InvalidParameter) as refused:
        client.attribution(
            AttributionJob(
                f"attr-{secrets.token_hex(4)}", "sae_t", 1, prompt_token_ids=PROMPT_IDS, target_token_id=10**6
            )
        )
    assert refused.value.param == "target_token_id"
    return [
        result.target_token_id,
        round(result.target_logit, 4),
        row_ptr.tolist(),
        [round(float(v), 4) for v in values],
        [
            [f.index, round(f.attribution, 4), f.max_position, f.ablation_delta and round(f.ablation_delta, 4)]
            for f in result.top
        ],
    ]


def step_cancel_all(client, assets, ref):
    assert client.cancel_all(reason="test") == 0  # nothing running
    events = _long_generation(client, f"long-{secrets.token_hex(4)}")
    assert client.cancel_all(reason="test") == 1
    rest = list(events)
    assert isinstance(rest[-1], ErrorEvent) and rest[-1].code == EngineBusy.code
    assert rest[-1].details == {"reason": "test"}
    assert len(rest) - 1 < 470  # stopped long before its end
    return [rest[-1].code, rest[-1].details]


def step_detach(client, assets, ref):
    assert client.detach("sae_t", 1) == [("sae_t", 1)]
    assert client.attachments() == []
    return client.detach() == []


def step_build_grammar(client, assets, ref):
    built = client.build_grammar(
        StructuredOutput(
            "json_schema",
            json.dumps({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
        )
    )
    with pytest.raises(ResponseFormatUnsupported) as refused:
        client.build_grammar(StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"})))
    return [built, refused.value.details["param"]]


def step_unload_model(client, assets, ref):
    assert client.unload_model() is None
    assert client.status().state == "empty"
    return client.status().model_id


STEPS: dict[str, Step] = {
    "status": step_status,
    "check_load": step_check_load,
    "load_model": step_load_model,
    "check_sae": step_check_sae,
    "attach_set": step_attach_set,
    "generate": step_generate,
    "embed": step_embed,
    "score": step_score,
    "hidden_states": step_hidden_states,
    "tokenize": step_tokenize,
    "feature_logits": step_feature_logits,
    "attribution": step_attribution,
    "cancel_all": step_cancel_all,
    "build_grammar": step_build_grammar,
    "detach": step_detach,
    "unload_model": step_unload_model,
}


def test_every_command_is_exercised_here():
    """A command added to the table without a step below fails here."""
    assert sorted(STEPS) == sorted(COMMANDS)


def test_every_command_through_both_transports(redis_url, tiny_assets, reference):
    seen: dict[str, dict[str, Any]] = {}
    for name, transport in (("embedded", embedded), ("redis", over_redis)):
        with transport(redis_url, f"t{secrets.token_hex(4)}") as client:
            seen[name] = {
                cmd: json.loads(msgspec.json.encode(step(client, tiny_assets, reference)))
                for cmd, step in STEPS.items()
            }
    assert seen["redis"] == seen["embedded"]


def test_a_class_missing_a_command_is_refused():
    class Partial:
        def status(self): ...
        def load_model(self, job, *, timeout_s=None): ...
        def detach(self, layer, sae_id, *, timeout_s=None): ...

    with pytest.raises(TypeError) as err:
        check_implements(Partial)
    message = str(err.value)
    assert "cancel_all: missing" in message and "generate: missing" in message
    assert "detach('layer', 'sae_id', 'timeout_s')" in message
    assert not re.search(r"\b(load_model|status)\b", message)  # those two are right
    check_implements(Engine)
    check_implements(FakeEngine)  # the transport tests' stand-in speaks the same protocol


def test_a_transport_cannot_answer_a_command_itself():
    """Transports implement invoke() only: a client class that answers a command on its
    own (and could drift from the table) is refused when it is defined."""
    with pytest.raises(TypeError, match=r"overrides \['cancel_all', 'status'\]"):

        class Drifting(EmbeddedEngineClient):
            def status(self): ...
            def cancel_all(self, *, reason="x"): ...


def test_an_unknown_or_misrouted_command_is_answered_not_dropped(redis_url):
    """A command this engine does not know (a newer web tier) gets an error reply at once,
    as does one sent on the wrong stream; neither waits for a timeout."""
    prefix = f"t{secrets.token_hex(4)}"
    keys = Keys(prefix)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with running_server(redis_url, FakeEngine(), prefix):
            for stream, kind in (
                (keys.commands, "reticulate_splines"),
                (keys.commands, "generate"),
                (keys.requests, "load_model"),
            ):
                rid = f"cmd-{secrets.token_hex(4)}"
                r.set(keys.live(rid), "1", px=5000)
                env = Envelope(kind, rid, msgspec.Raw(b"{}"), time.time() + 30, time.time())
                r.xadd(stream, env.encode())
                reply = r.xread({keys.events(rid): "0-0"}, count=1, block=5000)
                assert reply, f"no reply to {kind} on {stream}"
                event = decode_event(reply[0][1][0][1])
                assert isinstance(event, ErrorEvent) and event.code == "invalid_parameter"
                assert event.details == {"param": "kind"} and kind in event.message
    finally:
        r.close()


def test_results_decode_into_their_declared_types():
    """The table's result types are what msgspec decodes a reply into (no hand-written
    from_dict): a detach reply is a list of (sae_id, layer) tuples."""
    assert from_json(b'[["a",1],["b",2]]', COMMANDS["detach"].result) == [("a", 1), ("b", 2)]
    assert from_json(b"null", COMMANDS["unload_model"].result) is None
