"""/v1's on-demand load of a quantized row: a Q8 model loads quantized and serves, a Q2
model is a 400 ``unsupported_quantization`` before anything is swapped."""

from __future__ import annotations

from registry import services
from registry.models import Model
from tests.v1.helpers import assert_openai_error, request


def test_a_q8_row_is_loaded_quantized_on_demand(llama, openai_client, tiny_assets):
    services.model_register_local(
        local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama-q8", quantization="Q8"
    )
    out = openai_client.completions.create(model="tiny-llama-q8", prompt="the sea", max_tokens=3, temperature=0)
    assert out.model == "tiny-llama-q8" and out.usage.completion_tokens == 3
    status = llama.engine.status()
    assert status.model_id == "tiny-llama-q8" and status.weights["quantization"] == "Q8"
    assert status.weights["bytes_by_dtype"]["int8"] > 0
    assert Model.objects.get(name="tiny-llama-q8").status == Model.Status.LOADED


def test_a_q2_row_is_refused_without_swapping(llama, tiny_assets):
    services.model_register_local(
        local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2-q2", quantization="Q2"
    )
    resp = request(
        llama.base_url, "POST", "/completions", {"model": "tiny-gpt2-q2", "prompt": "the sea", "max_tokens": 3}
    )
    error = assert_openai_error(resp, 400, "unsupported_quantization")
    assert "2-bit" in error["message"]
    assert llama.engine.status().model_id == "tiny-llama"
    assert Model.objects.get(name="tiny-gpt2-q2").status == Model.Status.READY
