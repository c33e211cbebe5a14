"""An inference key's /v1 request never changes what the engine holds: naming a model that
is not resident is 409 ``model_not_resident`` (it used to unload everyone's model and load
its own), on every generation route; an admin key loads on demand as before."""

from __future__ import annotations

import pytest

from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

BODIES = {
    "/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/completions": {"prompt": "hi", "max_tokens": 2},
    "/embeddings": {"input": "hi"},
}


def test_an_inference_key_never_swaps_the_resident_model(llama, settings):
    settings.MILLM_API_KEYS = ("bob:kb",)
    settings.MILLM_ADMIN_API_KEYS = ("root:kr",)
    bob = {"Authorization": "Bearer kb"}
    for path, body in BODIES.items():
        answer = request(llama.base_url, "POST", path, {**body, "model": "tiny-gpt2"}, headers=bob)
        assert answer.status == 409, (path, answer.body[:300])
        error = answer.json()["error"]
        assert error["code"] == "model_not_resident" and error["param"] == "model"
        assert "MILLM_ADMIN_API_KEYS" in error["message"]
        assert llama.engine.status().model_id == "tiny-llama"
        # the resident model serves the same key
        assert request(llama.base_url, "POST", path, {**body, "model": "tiny-llama"}, headers=bob).status == 200, path
    # asking for auto explicitly changes nothing
    answer = request(
        llama.base_url,
        "POST",
        "/completions",
        {**BODIES["/completions"], "model": "tiny-gpt2"},
        headers={**bob, "X-miLLM-Load-Policy": "auto"},
    )
    assert answer.status == 409 and llama.engine.status().model_id == "tiny-llama"
