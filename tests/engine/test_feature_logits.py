"""``feature_logits`` and ``tokenize`` on every backend, against the files themselves.

On the demo SmolLM2-135M with its SAE attached, each backend (transformers, vLLM and
llama.cpp where installed; ``MILLM_REQUIRE_VLLM`` / ``MILLM_REQUIRE_LLAMACPP`` make
those required) answers feature_logits with the test's own float64 ``W_dec[i] @ W_U.T``
(W_dec from the SAE's safetensors, W_U the checkpoint's unembedding: its ``lm_head`` or
the tied input embedding) — every feature of the SAE, top and bottom — and names each
token as the tokenizer decodes that one id; an SAE not attached at the layer and a feature
index past the SAE are refused by name; tokenize equals the checkpoint tokenizer's own
encoding.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from gpu_engine.api.errors import InvalidFeatureIndex, InvalidParameter, SAENotAttached
from gpu_engine.api.protocol import AttachSpec, FeatureLogitsJob, TokenizeJob
from gpu_engine.runtime.engine import Engine
from tests.fixtures.backends import require_backend
from tests.fixtures.llamacpp import gguf_copy

from .test_backend_parity import demo_loads

TOP_N = 10
# float32 products over d_model = 576 terms of values ≲ 0.1 against float64: ~1e-6
LOGIT_ATOL = 1e-4
TEXTS = [
    "The ocean waves crashed against the shore.",
    "A formal letter to the committee, 3 pages long",
    "  two leading spaces and a trailing one ",
]


@pytest.fixture(scope="module")
def demo(demo_assets):
    from offline_assets import DEMO_MODEL_NAME, DEMO_SAE_NAME

    model = demo_assets.models[DEMO_MODEL_NAME]
    sae = demo_assets.saes[DEMO_SAE_NAME]
    return model, sae


@pytest.fixture(scope="module")
def truth(demo):
    """The test's own logit effects (float64) and the checkpoint's tokenizer."""
    model, sae = demo
    w_dec = load_file(str(Path(sae.path) / "sae_weights.safetensors"))["W_dec"].astype(np.float64)
    weights = load_file(str(Path(model.path) / "model.safetensors"))
    name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    w_u = weights[name].astype(np.float64)
    return w_dec @ w_u.T, AutoTokenizer.from_pretrained(str(model.path))


@pytest.mark.parametrize("backend", ["transformers", "vllm", "llamacpp"])
def test_feature_logits_and_tokenize_equal_the_files(demo, truth, backend):
    model, sae = demo
    if backend != "transformers":
        require_backend(backend)
    logits, tok = truth
    gguf = gguf_copy(Path(model.path)) if backend == "llamacpp" else None
    hf_load, vllm_load, gguf_load = demo_loads(model, gguf)
    load = {"vllm": vllm_load, "llamacpp": gguf_load}.get(backend, hf_load)
    eng = Engine(drain_timeout_s=300)
    try:
        eng.load_model(load)
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        every = eng.feature_logits(FeatureLogitsJob("all", sae.name, sae.layer, top_n=TOP_N))
        chosen = eng.feature_logits(FeatureLogitsJob("some", sae.name, sae.layer, features=[3, 0, 1000], top_n=3))
        with pytest.raises(SAENotAttached) as not_attached:
            eng.feature_logits(FeatureLogitsJob("x", sae.name, sae.layer + 1))
        with pytest.raises(InvalidFeatureIndex) as past:
            eng.feature_logits(FeatureLogitsJob("x", sae.name, sae.layer, features=[0, logits.shape[0]]))
        tokenized = eng.tokenize(TokenizeJob("t", TEXTS))
        with_special = eng.tokenize(TokenizeJob("t", TEXTS, add_special_tokens=True))
    finally:
        eng.shutdown()
        del eng
        gc.collect()

    d_sae = logits.shape[0]
    assert every.features == list(range(d_sae))
    for name in ("top_ids", "top_values", "bottom_ids", "bottom_values", "top_tokens", "bottom_tokens"):
        assert [len(row) for row in getattr(every, name)] == [TOP_N] * d_sae, name
    order = np.argsort(logits, axis=1)
    top_want = np.take_along_axis(logits, order[:, ::-1][:, :TOP_N], 1)
    bottom_want = np.take_along_axis(logits, order[:, :TOP_N], 1)
    # the values are the highest and lowest, in order; the ids named carry them (two ids
    # tied within float32 rounding may come in either order)
    np.testing.assert_allclose(every.top_values, top_want, atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_allclose(every.bottom_values, bottom_want, atol=LOGIT_ATOL, rtol=0)
    rows = np.arange(d_sae)[:, None]
    np.testing.assert_allclose(logits[rows, np.array(every.top_ids)], every.top_values, atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_allclose(logits[rows, np.array(every.bottom_ids)], every.bottom_values, atol=LOGIT_ATOL, rtol=0)
    # the features differ: the comparison is not of one repeated row
    assert len({tuple(r) for r in every.top_ids}) > d_sae // 2

    # token texts: the backend's tokenizer reading one id, as logprob tokens are named;
    # the checkpoint's tokenizer agrees wherever that one id is whole UTF-8 text
    texts = {
        i: t
        for ids, ts in ((every.top_ids, every.top_tokens), (every.bottom_ids, every.bottom_tokens))
        for row_i, row_t in zip(ids, ts)
        for i, t in zip(row_i, row_t)
    }
    whole = {i: t for i, t in texts.items() if "\ufffd" not in tok.decode([i])}
    assert len(whole) > len(texts) // 2

    # (llama.cpp's detokenizer drops a space before punctuation, " ." -> ".", as
    # transformers' clean_up_tokenization does; its logprob tokens read the same)
    def decoded(i: int) -> str:
        text = tok.decode([i], clean_up_tokenization_spaces=False)
        return tok.clean_up_tokenization(text) if backend == "llamacpp" else text

    assert {i: t for i, t in whole.items() if t != decoded(i)} == {}

    # a chosen subset, in the order asked
    assert chosen.features == [3, 0, 1000]
    for j, f in enumerate(chosen.features):
        assert chosen.top_values[j] == pytest.approx(top_want[f][:3].tolist(), abs=LOGIT_ATOL)
        assert chosen.bottom_values[j] == pytest.approx(bottom_want[f][:3].tolist(), abs=LOGIT_ATOL)

    assert not_attached.value.details == {"sae_id": sae.name, "layer": sae.layer + 1}
    assert past.value.details["param"] == "features" and past.value.details["feature_idx"] == d_sae

    assert tokenized.token_ids == [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    special = [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS]
    if backend == "llamacpp":
        # the GGUF's own rule for special tokens (its metadata; the converter sets
        # add_bos_token where transformers' tokenizer adds none)
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf)).fields
        if fields["tokenizer.ggml.add_bos_token"].contents():
            bos = fields["tokenizer.ggml.bos_token_id"].contents()
            special = [[bos, *tok(t, add_special_tokens=False)["input_ids"]] for t in TEXTS]
    assert with_special.token_ids == special


def test_feature_logits_jobs_are_checked_before_they_reach_a_model():
    with pytest.raises(InvalidParameter) as twice:
        FeatureLogitsJob("x", "s", 0, features=[1, 2, 1])
    assert twice.value.details["param"] == "features"
    for top_n in (0, 101):
        with pytest.raises(InvalidParameter) as bad:
            FeatureLogitsJob("x", "s", 0, top_n=top_n)
        assert bad.value.details["param"] == "top_n"
    with pytest.raises(InvalidParameter):
        FeatureLogitsJob("x", "s", 0, features=[-1])
    with pytest.raises(InvalidParameter):
        TokenizeJob("t", [])
    with pytest.raises(InvalidParameter):
        TokenizeJob("t", ["a"] * 4097)
