"""Sweeps end to end on the real engine (docs/experiments.md, "Sweeps"), through
``POST /api/experiments/sweep`` on the live server, every figure checked against what the
test computes itself:

- a point's tokens and its target activations (before and after the layer's steering)
  equal the same request sent alone to /v1 (``/v1/completions`` for a text prompt,
  ``/v1/chat/completions`` for messages, with ``return_sae_activations``);
- KL(steered ‖ default) at each position equals the test's own, from its own float64
  softmaxes of its own forward of the checkpoint, teacher-forced on the default
  continuation; strength 0 gives KL 0;
- the log-likelihood of each text under the unsteered model equals the test's own.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.experiments.conftest import (
    ACT_ATOL,
    KL_ATOL,
    KL_RTOL,
    LOGLIK_ATOL,
    SAE,
    api,
    ok,
    wait_run,
)

pytestmark = pytest.mark.django_db(transaction=True)

FEATURE = 3
STRENGTHS = [0.0, 6.0]
PROMPTS = ["the cat sat on the mat and then it", {"messages": [{"role": "user", "content": "a quick brown fox"}]}]
MAX_TOKENS = 6


def v1_same(server, prompt, strength: float, read_point: str, sae_id: str) -> dict:
    """The point's request sent alone to /v1, its activations read at ``read_point``."""
    body = {
        "model": "tiny-llama",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "steering": {"sae_id": sae_id, "features": [{"index": FEATURE, "strength": strength}]},
        "return_sae_activations": {
            "sae_id": sae_id,
            "features": [FEATURE],
            "positions": "all",
            "read_point": read_point,
        },
    }
    if isinstance(prompt, str):
        status, data = api(server, "POST", "/v1/completions", {**body, "prompt": prompt})
        assert status == 200, data
        text = data["choices"][0]["text"]
    else:
        status, data = api(server, "POST", "/v1/chat/completions", {**body, **prompt})
        assert status == 200, data
        text = data["choices"][0]["message"]["content"]
    acts = data["millm"]["sae_activations"]
    return {
        "text": text,
        "positions": [
            (
                p["position"],
                p["token_id"],
                next(f["activation"] for f in p["features"] if f["feature_index"] == FEATURE),
            )
            for p in acts["positions"]
        ],
    }


def test_a_sweep_matches_v1_and_the_tests_own_kl_and_loglik(sae, llama, own):
    run = ok(
        api(
            llama,
            "POST",
            "/api/experiments/sweep",
            {
                "prompts": PROMPTS,
                "variants": [{"sae_id": sae.id, "index": FEATURE}],
                "strengths": STRENGTHS,
                "max_tokens": MAX_TOKENS,
            },
        ),
        202,
    )["run"]
    assert run["kind"] == "sweep" and run["status"] == "queued" and run["total"] == 2 * (1 + 2)
    done = wait_run(run["id"])
    assert done.status == "completed", done.error
    assert done.done == done.total == 6 and not done.partial
    assert done.result["kl_unavailable"] is None and done.result["loglik_unavailable"] is None

    points = ok(api(llama, "GET", f"/api/experiments/{run['id']}/points"))
    assert points["total"] == 6
    rows = {(p["prompt_index"], p["is_default"], p["strength"]): p for p in points["points"]}
    assert [p["ordinal"] for p in points["points"]] == list(range(6))

    for pi, prompt in enumerate(PROMPTS):
        default = rows[(pi, True, None)]
        from experiments.models import ExperimentPoint

        prompt_ids = ExperimentPoint.objects.get(run_id=run["id"], ordinal=default["ordinal"]).data["prompt_token_ids"]
        if isinstance(prompt, str):  # the engine's tokens are the tokenizer's own
            assert prompt_ids == own.tokenizer(prompt)["input_ids"]
        cont = default["token_ids"]
        assert 0 < len(cont) <= MAX_TOKENS
        # the default is /v1 explicitly unsteered
        alone = v1_same(llama, prompt, 0.0, "post_steering", sae.id)
        assert default["text"] == alone["text"]
        # its log-likelihood under the unsteered model: the test's own
        want = own.loglik(prompt_ids, cont)
        assert default["loglik_per_token"] == pytest.approx(want.tolist(), abs=LOGLIK_ATOL)
        assert default["loglik"] == pytest.approx(want.sum(), abs=LOGLIK_ATOL)

        for strength in STRENGTHS:
            point = rows[(pi, False, strength)]
            assert point["variant_index"] == 0
            # tokens and activations: the same request sent alone to /v1
            after = v1_same(llama, prompt, strength, "post_steering", sae.id)
            before = v1_same(llama, prompt, strength, "pre_steering", sae.id)
            assert point["text"] == after["text"] == before["text"]
            seq = [*prompt_ids, *point["token_ids"]]
            for got, alone in (
                (point["target_after_per_position"], after),
                (point["target_before_per_position"], before),
            ):
                assert [g["position"] for g in got] == [p for p, _, _ in alone["positions"]]
                assert [seq[g["position"]] for g in got] == [t for _, t, _ in alone["positions"]]
                assert [g["activation"] for g in got] == pytest.approx([a for _, _, a in alone["positions"]], abs=1e-6)
            assert point["target_after"] == pytest.approx(
                np.mean([g["activation"] for g in point["target_after_per_position"]]), rel=1e-9
            )
            # the test's own encode of its own residual agrees (before the steering: the raw row)
            # KL teacher-forced on the default continuation: the test's own float64
            kl = own.kl(prompt_ids, cont, {FEATURE: strength})
            assert point["kl_per_position"] == pytest.approx(kl.tolist(), rel=KL_RTOL, abs=KL_ATOL)
            assert point["kl_mean"] == pytest.approx(kl.mean(), rel=KL_RTOL, abs=KL_ATOL)
            if strength == 0:
                assert point["kl_mean"] == pytest.approx(0.0, abs=1e-9)
                assert max(abs(v) for v in point["kl_per_position"]) <= 1e-9
                assert point["target_before"] == pytest.approx(point["target_after"], abs=ACT_ATOL)
            else:
                # positive control: this steer moves the distribution measurably
                assert kl.mean() > 1e-3
                # the steering raises the target feature after the layer's delta
                assert point["target_after"] > point["target_before"]
            # the steered text's log-likelihood under the unsteered model
            ll = own.loglik(prompt_ids, point["token_ids"])
            assert point["loglik_per_token"] == pytest.approx(ll.tolist(), abs=LOGLIK_ATOL)
            assert point["loglik"] == pytest.approx(ll.sum(), abs=LOGLIK_ATOL)


def test_a_sweep_with_a_clamp_and_a_phase_gated_add(sae, llama, own):
    """A clamp's strength is its target and a control gated to the completion is gated to
    the same rows in the teacher-forced pass: KL agrees with the test's own forward that
    adds only at those rows."""
    prompt = PROMPTS[0]
    run = ok(
        api(
            llama,
            "POST",
            "/api/experiments/sweep",
            {
                "prompts": [prompt],
                "variants": [
                    {"sae_id": sae.id, "index": FEATURE, "mode": "add", "phase": "completion"},
                    {"sae_id": sae.id, "index": FEATURE, "mode": "clamp"},
                ],
                "strengths": [5.0],
                "max_tokens": MAX_TOKENS,
            },
        ),
        202,
    )["run"]
    done = wait_run(run["id"])
    assert done.status == "completed", done.error
    from experiments.models import ExperimentPoint

    default = ExperimentPoint.objects.get(run_id=run["id"], is_default=True)
    prompt_ids, cont = default.data["prompt_token_ids"], default.token_ids
    gated = ExperimentPoint.objects.get(run_id=run["id"], variant_index=0)
    # the add at the rows of generated tokens only: rows p0.. of the teacher-forced pass
    ids = [*prompt_ids, *cont]
    p0, n = len(prompt_ids), len(cont)
    delta = own.ref.delta({FEATURE: 5.0})
    import torch

    mask = torch.zeros(len(ids), 1, dtype=torch.float64)
    mask[p0:] = 1.0
    from tests.experiments.conftest import _adding

    with torch.no_grad(), _adding(own.block, mask * torch.tensor(delta)):
        logits = own.model(torch.tensor([ids])).logits[0]
    s = torch.log_softmax(logits.double(), dim=-1).numpy()[p0 - 1 : p0 - 1 + n]
    r = own.log_softmax(ids)[p0 - 1 : p0 - 1 + n]
    want = (np.exp(s) * (s - r)).sum(axis=1)
    assert gated.kl_per_position == pytest.approx(want.tolist(), rel=KL_RTOL, abs=KL_ATOL)
    assert gated.kl_per_position[0] == pytest.approx(0.0, abs=1e-9)  # row p0-1 is the prompt's
    assert max(gated.kl_per_position[1:] or [1.0]) > 0 or n == 1
    # the target's steered positions are the generated tokens' rows
    after = gated.target_after_per_position
    assert gated.target_after == pytest.approx(np.mean([a["activation"] for a in after if a["position"] >= p0]))
    clamp = ExperimentPoint.objects.get(run_id=run["id"], variant_index=1)
    # the clamp moved the feature (its value after the layer's steering differs from before)
    assert clamp.target_after != pytest.approx(clamp.target_before, abs=1e-3)
    assert clamp.kl_mean is not None and clamp.kl_mean > 0
    assert SAE  # the SAE the fixture attached
