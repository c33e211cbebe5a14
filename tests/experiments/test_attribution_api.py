"""``POST /api/experiments/attribution`` against the live daphne of tests/v1, on tiny-llama
with its layer-1 ReLU SAE attached (docs/experiments.md, "Attribution").

Every figure is the test's own, in float64, from the checkpoint and the SAE's files read
here (``transformers`` in float64, ``tests.engine.helpers.RefSAE``), never from the
engine's code:

- the prompt's tokens are the checkpoint tokenizer's, and the greedy target its argmax;
- the top feature's attribution equals a central finite difference of the target logit
  when that feature's decoder contribution is scaled by ``1 ± h`` at every position (the
  derivative of the logit along ``f_i(x_p) W_dec[i]``, which is Σ_p f_i · ∂logit/∂f_i);
- every feature's attribution at every position equals the test's own autograd
  (``f_i(x_p) · W_dec[i] · ∂logit/∂x_p``), so the heat strip's totals and the ranking of the
  top features are checked too;
- each ablation check equals the test's own forward with ``-f_i(x_p) W_dec[i]`` added at
  every position, minus the clean logit.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from registry.models import FeatureExplanation
from tests.engine.helpers import RefSAE
from tests.v1.conftest import _v1_db, attach, llama, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

SAE, LAYER = "tiny-llama-L1-relu", 1
PROMPT = "the quick brown fox jumps over the lazy dog and the"
# float32 engine against float64: logits of a few units agree to ~1e-5
LOGIT_ATOL = 2e-4
ATTR_RTOL, ATTR_ATOL = 2e-3, 2e-4
FD_STEP = 1e-4


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class Reference:
    """tiny-llama in float64 with the SAE read from its files."""

    def __init__(self, assets) -> None:
        model_asset, sae_asset = assets.models["tiny-llama"], assets.saes[SAE]
        self.tok = AutoTokenizer.from_pretrained(str(model_asset.path))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_asset.path), dtype=torch.float64, attn_implementation="sdpa"
        ).eval()
        # transformers' RMSNorm computes in float32 whatever the weights (and its eager
        # attention's softmax too, hence sdpa): a finite difference would then see float32
        # rounding, so every norm here computes in float64
        for module in self.model.modules():
            if hasattr(module, "variance_epsilon"):
                module.forward = types.MethodType(_rms_norm_float64, module)
        self.block = self.model.get_submodule(model_asset.layer_module_path(LAYER))
        self.sae = RefSAE(sae_asset)

    def _run(self, ids: list[int], delta: torch.Tensor | None = None, grad: bool = False):
        seen: list[torch.Tensor] = []
        zero = torch.zeros(1, len(ids), self.model.config.hidden_size, dtype=torch.float64, requires_grad=grad)

        def hook(mod, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            seen.append(hidden[0].detach().clone())
            hidden = hidden + zero + (delta if delta is not None else 0.0)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        handle = self.block.register_forward_hook(hook)
        try:
            with torch.set_grad_enabled(grad):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
        finally:
            handle.remove()
        return logits, seen[0].numpy(), zero

    def logits(self, ids: list[int], delta: np.ndarray | None = None) -> np.ndarray:
        d = None if delta is None else torch.tensor(delta[None], dtype=torch.float64)
        with torch.no_grad():
            return self._run(ids, d)[0].numpy()

    def features(self, ids: list[int]) -> np.ndarray:
        """f(x_p) of every position: (positions, d_sae)."""
        return self.sae.encode(self._run(ids)[1])

    def attributions(self, ids: list[int], target: int) -> np.ndarray:
        """f_i(x_p) · W_dec[i] · ∂logit/∂x_p by autograd: (positions, d_sae)."""
        logits, x, zero = self._run(ids, grad=True)
        logits[target].backward()
        grad = zero.grad[0].numpy()
        return self.sae.encode(x) * (grad @ self.sae.W_dec.T)

    def finite_difference(self, ids: list[int], target: int, index: int) -> float:
        f = self.features(ids)
        direction = f[:, index : index + 1] * self.sae.W_dec[index][None, :]
        up = self.logits(ids, FD_STEP * direction)[target]
        down = self.logits(ids, -FD_STEP * direction)[target]
        return float((up - down) / (2 * FD_STEP))

    def ablation(self, ids: list[int], target: int, index: int) -> float:
        f = self.features(ids)
        delta = -f[:, index : index + 1] * self.sae.W_dec[index][None, :]
        return float(self.logits(ids, delta)[target] - self.logits(ids)[target])


@pytest.fixture(scope="module")
def ref(tiny_assets) -> Reference:
    return Reference(tiny_assets)


@pytest.fixture
def attached(llama):
    """The live server, tiny-llama resident with the SAE attached at layer 1."""
    attach(SAE, LAYER)
    return llama


def post(server, body: dict) -> tuple[int, dict]:
    resp = request(server.url, "POST", "/api/experiments/attribution", body, timeout=120)
    return resp.status, resp.json()


def ok(server, body: dict) -> dict:
    status, answer = post(server, body)
    assert status == 200 and answer["success"] is True, answer
    return answer["data"]


def check_against_reference(data: dict, ref: Reference, ids: list[int], target: int) -> None:
    assert [t["id"] for t in data["tokens"]] == ids
    assert data["target"]["id"] == target
    clean = ref.logits(ids)
    np.testing.assert_allclose(data["target"]["logit"], clean[target], atol=LOGIT_ATOL)

    a = ref.attributions(ids, target)  # (positions, d_sae)
    summed = a.sum(axis=0)
    features = data["features"]
    assert len(features) == min(data["top_n"], int(np.count_nonzero(summed)))
    # the ranking: by |summed attribution|, largest first (a near tie may swap two)
    want = np.argsort(-np.abs(summed), kind="stable")[: len(features)].tolist()
    got = [f["index"] for f in features]
    mags = np.abs(summed)
    assert all(abs(mags[g] - mags[w]) <= ATTR_ATOL for g, w in zip(got, want, strict=True)), (got, want)
    f = ref.features(ids)
    for feat in features:
        i = feat["index"]
        np.testing.assert_allclose(feat["attribution"], summed[i], rtol=ATTR_RTOL, atol=ATTR_ATOL)
        np.testing.assert_allclose(feat["activation_sum"], f[:, i].sum(), rtol=1e-4, atol=1e-4)
        p = feat["max_position"]
        np.testing.assert_allclose(feat["max_attribution"], a[p, i], rtol=ATTR_RTOL, atol=ATTR_ATOL)
        assert abs(a[p, i]) >= np.abs(a[:, i]).max() - ATTR_ATOL
        assert feat["dashboard"] == f"/features/{data['sae_id']}/{i}/"

    # the top feature against the finite difference (not autograd: the definition itself)
    top = features[0]
    fd = ref.finite_difference(ids, target, top["index"])
    assert abs(fd) > 10 * ATTR_ATOL, "the top feature's attribution is too small to test anything"
    np.testing.assert_allclose(top["attribution"], fd, rtol=ATTR_RTOL, atol=ATTR_ATOL)

    # the ablation check: the first ablate_top features, against the test's own forward
    for k, feat in enumerate(features):
        if k < data["ablate_top"]:
            want_delta = ref.ablation(ids, target, feat["index"])
            np.testing.assert_allclose(feat["ablation_delta"], want_delta, atol=LOGIT_ATOL)
        else:
            assert feat["ablation_delta"] is None

    # the heat strip: per position, sum |a| and sum a over every feature, and its largest
    assert [h["position"] for h in data["heat"]] == list(range(len(ids)))
    for p, h in enumerate(data["heat"]):
        np.testing.assert_allclose(h["total"], np.abs(a[p]).sum(), rtol=ATTR_RTOL, atol=ATTR_ATOL)
        np.testing.assert_allclose(h["sum"], a[p].sum(), rtol=ATTR_RTOL, atol=ATTR_ATOL)
        for t in h["top"]:
            np.testing.assert_allclose(t["attribution"], a[p, t["index"]], rtol=ATTR_RTOL, atol=ATTR_ATOL)
        if h["top"]:
            assert abs(h["top"][0]["attribution"]) >= np.abs(a[p]).max() - ATTR_ATOL


def test_a_prompt_against_the_tests_own_float64_figures(attached, ref):
    server = attached
    ids = ref.tok(PROMPT)["input_ids"]
    clean = ref.logits(ids)
    first, second = np.sort(clean)[-2:][::-1]
    assert first - second > 1e-3, "the greedy token is a near tie: pick another prompt"
    data = ok(server, {"sae_id": attached_id(), "prompt": PROMPT, "top_n": 8, "ablate_top": 3})
    assert (data["layer"], data["backend"], data["model"]) == (LAYER, "transformers", "tiny-llama")
    assert data["target"]["greedy"] is True
    check_against_reference(data, ref, ids, int(np.argmax(clean)))
    # the texts are the tokenizer's own, one id at a time
    assert [t["text"] for t in data["tokens"]] == [ref.tok.decode([i]) for i in ids]
    assert data["target"]["text"] == ref.tok.decode([data["target"]["id"]])


def test_a_chosen_target_by_id_and_by_text_and_a_label(attached, ref):
    server = attached
    ids = ref.tok(PROMPT)["input_ids"]
    greedy = int(np.argmax(ref.logits(ids)))
    # a token other than the greedy one that the tokenizer reads back as itself
    target = next(
        i
        for i in np.argsort(-ref.logits(ids)).tolist()[1:]
        if ref.tok.encode(ref.tok.decode([i]), add_special_tokens=False) == [i] and ref.tok.decode([i]).strip()
    )
    assert target != greedy
    by_id = ok(server, {"sae_id": attached_id(), "prompt": PROMPT, "target_token": target, "ablate_top": 2})
    assert by_id["target"]["greedy"] is False
    check_against_reference(by_id, ref, ids, target)
    by_text = ok(
        server, {"sae_id": attached_id(), "prompt": PROMPT, "target_token": ref.tok.decode([target]), "ablate_top": 2}
    )
    assert by_text["target"]["id"] == target and by_text["features"] == by_id["features"]

    # a label the top feature has is answered beside it, in the list and in the heat strip
    top = by_id["features"][0]["index"]
    FeatureExplanation.objects.create(
        sae_id=attached_id(), index=top, description="foxes and dogs", source=FeatureExplanation.Source.USER
    )
    again = ok(server, {"sae_id": attached_id(), "prompt": PROMPT, "target_token": target, "ablate_top": 0})
    assert again["features"][0]["label"] == "foxes and dogs"
    assert all(f["ablation_delta"] is None for f in again["features"])
    shown = [t for h in again["heat"] for t in h["top"] if t["index"] == top]
    assert shown and all(t["label"] == "foxes and dogs" for t in shown)


def test_a_conversation_reads_the_chat_template(attached, ref):
    server = attached
    messages = [{"role": "user", "content": "tell me about the fox"}]
    text = ref.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = ref.tok(text, add_special_tokens=False)["input_ids"]
    data = ok(server, {"sae_id": attached_id(), "messages": messages, "top_n": 5, "ablate_top": 1})
    check_against_reference(data, ref, ids, int(np.argmax(ref.logits(ids))))


def attached_id() -> str:
    from registry.models import SAE as SAERow

    return SAERow.objects.get(name=SAE).id
