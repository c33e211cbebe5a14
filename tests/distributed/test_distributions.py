"""Teacher-forced distributions (``GenerationJob.distributions_from``) over the Redis
Streams transport, against a real redis-server and the real engine: the job's field
reaches the engine, the finish's ``Distributions`` comes back byte for byte as the engine
in process gives it (and equal to the test's own float64 forward of the checkpoint), and a
start past the prompt is refused naming the field."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.engine_client_redis import RedisEngineClient
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    GenerationResult,
    LoadModelJob,
    SamplingParams,
    SteeringSpec,
    unpack_distributions,
)
from gpu_engine.runtime.engine import Engine
from tests.distributed.fakes import FAST, running_server
from tests.engine.tolerances import DISTRIBUTION_ATOL


@pytest.fixture
def prefix() -> str:
    return f"t{secrets.token_hex(4)}"


def test_distributions_over_redis_equal_the_engine_in_process(redis_url, prefix, tiny_assets):
    model = tiny_assets.models["tiny-llama"]
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    engine = Engine()
    try:
        with running_server(redis_url, engine, prefix):
            client = RedisEngineClient(
                url=redis_url,
                prefix=prefix,
                heartbeat_s=FAST["heartbeat_s"],
                dead_after_s=FAST["dead_after_s"],
                command_timeout_s=10,
            )
            client.load_model(LoadModelJob(model_id="tiny-llama", path=str(model.path), dtype="float32", device="cpu"))
            client.attach_set([AttachSpec(sae_id="sae_t", path=str(sae.path), layer=1)])
            ids = engine.backend.encode_text("the sea is wide and the sky")

            def job(rid: str, start: int, steered: bool) -> GenerationJob:
                return GenerationJob(
                    request_id=f"{rid}-{secrets.token_hex(4)}",  # each request id once
                    prompt_token_ids=ids,
                    sampling=SamplingParams(max_tokens=1, temperature=0),
                    steering=SteeringSpec.from_mapping({("sae_t", 1): {3: 4.0}}) if steered else None,
                    distributions_from=start,
                )

            for steered in (False, True):
                remote = GenerationResult.from_events(client.generate(job("r", 2, steered)).events(30))
                local = GenerationResult.from_events(engine.generate(job("l", 2, steered)).events(30))
                assert remote.distributions == local.distributions
                assert remote.distributions.rows == len(ids) - 2
            # the unsteered rows are the checkpoint's own, in float64
            ref = AutoModelForCausalLM.from_pretrained(str(model.path), torch_dtype=torch.float64)
            with torch.no_grad():
                lsm = torch.log_softmax(ref(torch.tensor([ids])).logits[0], dim=-1).numpy()
            plain = GenerationResult.from_events(client.generate(job("p", 1, False)).events(30))
            np.testing.assert_allclose(unpack_distributions(plain.distributions), lsm[:-1], atol=DISTRIBUTION_ATOL)
            # refused by name, before anything runs
            [error] = list(client.generate(job("late", len(ids), False)).events(30))
            assert error.code == "invalid_parameter" and error.details["param"] == "distributions_from"
    finally:
        engine.shutdown()
