"""vLLM has no teacher-forced distributions (``GenerationJob.distributions_from``): it hands
back a prompt position's top ``max_logprobs`` entries, never the whole row. The capability
says so with its reason, and a job asking for them is refused naming the field, with that
reason, while the engine goes on serving."""

from __future__ import annotations

from gpu_engine.api.protocol import GenerationJob, SamplingParams


def test_vllm_refuses_distributions_by_name_with_its_reason(vllm_engine):
    caps = vllm_engine.status().capabilities
    assert caps.prompt_distributions is False and "top-k" in caps.prompt_distributions_reason
    ids = vllm_engine.backend.encode_text("the cat sat on the mat")
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    [error] = list(
        vllm_engine.generate(GenerationJob("d", prompt_token_ids=ids, sampling=sampling, distributions_from=1)).events(
            120
        )
    )
    assert error.code == "invalid_parameter" and error.details["param"] == "distributions_from"
    assert error.details["capability"] == "prompt_distributions" and "vllm" in error.message
    assert error.details["reason"] == caps.prompt_distributions_reason
    # the same request without the field runs
    assert len(vllm_engine.generate_sync(GenerationJob("ok", prompt_token_ids=ids, sampling=sampling)).token_ids) == 2
