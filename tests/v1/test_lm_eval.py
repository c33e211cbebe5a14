"""lm-eval's ``local-completions`` model against the live server, on two tiny tasks with
local data files: log-likelihoods (echo + logprobs on /v1/completions) must equal the
engine's own scoring of the same token ids, and greedy generations with stop sequences
must equal the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams, ScoreJob

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"


@pytest.fixture
def lm_eval_env(monkeypatch, tmp_path):
    # the tasks name their data files relative to the repository; nothing may reach a hub
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # lm-eval's rule: trailing context spaces move to the continuation; the whole string
    # is encoded once and split, without special tokens
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def test_lm_eval_local_completions(llama, lm_eval_env, tiny_assets):
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tokenizer_path = str(tiny_assets.models["tiny-llama"].path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny-llama",
            "base_url": f"{llama.base_url}/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer_path,
            "tokenized_requests": True,
            "num_concurrent": 1,
            "max_retries": 1,
            "timeout": 120,
            "max_length": 512,
        },
        tasks=["millm_tiny_choice", "millm_tiny_generate"],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=True,
        batch_size=1,
        limit=None,
    )
    assert set(results["results"]) == {"millm_tiny_choice", "millm_tiny_generate"}
    assert 0.0 <= results["results"]["millm_tiny_choice"]["acc,none"] <= 1.0

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    engine = llama.engine
    choice_samples = results["samples"]["millm_tiny_choice"]
    assert len(choice_samples) == 4
    checked = 0
    for sample in choice_samples:
        for (context, continuation), resp in zip([a for a in (r for r in sample["arguments"])], sample["resps"]):
            loglikelihood, is_greedy = resp[0]
            ctx, cont = _encode_pair(tok, context, continuation)
            score = engine.score(ScoreJob("ref", prompt_token_ids=ctx + cont, prompt_logprobs=True))
            expected = sum(score.prompt_logprobs[len(ctx) :])
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-4)
            greedy = all(
                engine.score(ScoreJob("g", prompt_token_ids=(ctx + cont)[:i], top_k=1)).top[0].token_id
                == (ctx + cont)[i]
                for i in range(len(ctx), len(ctx + cont))
            )
            assert bool(is_greedy) == greedy
            checked += 1
    assert checked == 11

    for sample in results["samples"]["millm_tiny_generate"]:
        context, _gen_kwargs = sample["arguments"][0]
        ids = tok(context, add_special_tokens=False).input_ids
        ref = engine.generate_sync(
            GenerationJob(
                "ref",
                prompt_token_ids=ids,
                sampling=SamplingParams(max_tokens=8, temperature=0, seed=1234, stop=["\n", "</s>"]),
            )
        )
        assert sample["resps"][0][0] == ref.text
