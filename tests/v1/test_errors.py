"""Every refusal in OpenAI's shape with the documented code and status, raised by the
official client as the right exception class; malformed input is a 4xx, never a 500,
and the server keeps serving."""

from __future__ import annotations

import http.client
import math

import openai
import pytest

from tests.v1.helpers import assert_openai_error, request

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _still_serving(server) -> None:
    resp = request(server.base_url, "POST", "/chat/completions", CHAT)
    assert resp.status == 200, resp.body


def test_client_exception_classes(llama, openai_client):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.chat.completions.create(model="no-such-model", messages=msgs)
    assert err.value.code == "model_not_found" and err.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=100_000)
    assert err.value.code == "context_length_exceeded"
    assert "512" in err.value.message and "100000" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model="tiny-llama", prompt="x", temperature=3)
    assert err.value.code == "invalid_parameter" and err.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError) as err:  # a stream refused before it starts
        openai_client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=100_000, stream=True)
    assert err.value.code == "context_length_exceeded"


BAD_BODIES = [
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": 1e308}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("n", {"n": -1}),
    ("n", {"n": 10**9}),
    ("max_tokens", {"max_tokens": -5}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2**80}),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
    ("stop", {"stop": 7}),
    ("seed", {"seed": 2**70}),
    ("messages", {"messages": []}),
    ("messages[0].role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("model", {"model": 12}),
    ("stream", {"stream": "sometimes"}),
    ("logit_bias", {"logit_bias": {"5": 100.5}}),
    ("logit_bias", {"logit_bias": {"five": 1}}),
    ("top_logprobs", {"top_logprobs": 50, "logprobs": True}),
    ("steering.features", {"steering": {"features": "lots"}}),
    ("return_sae_activations.positions", {"return_sae_activations": {"top_k": 1, "positions": "most"}}),
]


@pytest.mark.parametrize("param,patch", BAD_BODIES, ids=[p for p, _ in BAD_BODIES])
def test_invalid_parameters_name_the_field(llama, param, patch):
    resp = request(llama.base_url, "POST", "/chat/completions", {**CHAT, **patch})
    assert_openai_error(resp, 400, "invalid_parameter", param)


def test_malformed_requests_are_4xx_and_the_server_keeps_serving(llama):
    base = llama.base_url
    cases = [
        (request(base, "POST", "/chat/completions", raw=b'{"model": "tiny-llama", '), 400, "invalid_json"),
        (request(base, "POST", "/chat/completions", raw=b"\xff\xfe\x00garbage"), 400, "invalid_json"),
        (request(base, "POST", "/chat/completions", raw=b"[1, 2, 3]"), 400, "invalid_json"),
        (request(base, "POST", "/chat/completions", raw=b"[" * 100_000 + b"]" * 100_000), 400, "invalid_json"),
        (
            request(
                base,
                "POST",
                "/chat/completions",
                raw=b'{"model":"tiny-llama","messages":[{"role":"user","content":"x"}],"temperature": NaN}',
            ),
            400,
            "invalid_parameter",
        ),
        (
            request(
                base,
                "POST",
                "/chat/completions",
                raw=b'{"model":"tiny-llama","messages":[{"role":"user","content":"x"}],"top_p": Infinity}',
            ),
            400,
            "invalid_parameter",
        ),
        (
            request(
                base,
                "POST",
                "/completions",
                raw=b'{"model":"tiny-llama","prompt":"x","max_tokens":' + b"9" * 5000 + b"}",
            ),
            400,
            "invalid_json",
        ),
        (
            request(
                base,
                "POST",
                "/chat/completions",
                raw=b"model=tiny-llama",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            ),
            415,
            "unsupported_media_type",
        ),
        (
            request(base, "POST", "/chat/completions", CHAT, headers={"Content-Type": "text/plain"}),
            415,
            "unsupported_media_type",
        ),
        (
            request(
                base,
                "POST",
                "/completions",
                raw=b'{"model": "tiny-llama", "prompt": "' + b"a" * (3 * 1024 * 1024) + b'"}',
            ),
            413,
            "request_too_large",
        ),
        (
            request(base, "POST", "/chat/completions", CHAT, headers={"X-Padding": "p" * 10_000}),
            431,
            "request_header_fields_too_large",
        ),
        (request(base, "GET", "/chat/completions"), 405, "method_not_allowed"),
        (request(base, "POST", "/models"), 405, "method_not_allowed"),
        (request(base, "GET", "/no/such/route"), 404, "unknown_url"),
        (
            request(base, "POST", "/chat/completions", CHAT, headers={"X-miLLM-Load-Policy": "sometimes"}),
            400,
            "invalid_parameter",
        ),
    ]
    for resp, status, code in cases:
        assert_openai_error(resp, status, code)
    _still_serving(llama)


def test_token_ids_outside_the_vocabulary(llama):
    for prompt in ([1, 2, 10**6], [[5, 6], [7, -1]]):
        resp = request(
            llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}
        )
        assert_openai_error(resp, 400, "invalid_parameter", "prompt")
    resp = request(llama.base_url, "POST", "/embeddings", {"model": "tiny-llama", "input": [[3, 4, 999_999]]})
    assert_openai_error(resp, 400, "invalid_parameter", "input")
    _still_serving(llama)


def test_header_beyond_the_servers_line_limit_is_refused_and_harmless(llama):
    # Twisted refuses header lines over 16 KiB before the application sees them: it
    # answers 400 or drops the connection, depending on when it notices.
    try:
        resp = request(llama.base_url, "POST", "/chat/completions", CHAT, headers={"X-Huge": "h" * 70_000})
    except (ConnectionError, http.client.HTTPException):
        pass
    else:
        assert 400 <= resp.status < 500
    _still_serving(llama)


def test_an_error_after_the_stream_started_is_a_frame_then_done(llama):
    # the second prompt's token ids are outside the vocabulary: the engine refuses it
    # after the first prompt has streamed
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": [[5, 6, 7], [5, 10**6]], "max_tokens": 3, "stream": True, "temperature": 0},
    )
    assert resp.status == 200
    events = resp.events()
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == "prompt"
    assert any(e["choices"][0]["text"] for e in events[:-2] if e.get("choices"))
    _still_serving(llama)


def test_context_length_error_carries_the_numbers(llama):
    resp = request(
        llama.base_url, "POST", "/completions", {"model": "tiny-llama", "prompt": [5] * 500, "max_tokens": 20}
    )
    error = assert_openai_error(resp, 400, "context_length_exceeded", "prompt")
    for number in ("512", "500", "20"):
        assert number in error["message"]
    assert not math.isnan(len(error["message"]))


BODIES = {
    "/chat/completions": CHAT,
    "/completions": {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4},
    "/embeddings": {"model": "tiny-llama", "input": "hi"},
}


def test_domain_errors_name_the_field_they_are_about(llama):
    """``param`` is the request field a refusal is about — the model or the profile —
    never the input (that is the context-length error's alone)."""
    from registry.models import Model
    from steering.services import profile_create
    from tests.v1.conftest import attach

    base = llama.base_url
    refuse = {"X-miLLM-Load-Policy": "refuse"}
    for path, body in BODIES.items():
        assert_openai_error(
            request(base, "POST", path, {**body, "model": "tiny-gpt2"}, headers=refuse),
            409,
            "model_not_resident",
            "model",
        )
        assert_openai_error(request(base, "POST", path, {**body, "model": "no-such"}), 404, "model_not_found", "model")
    generation = {k: v for k, v in BODIES.items() if k != "/embeddings"}
    for path, body in generation.items():
        assert_openai_error(
            request(base, "POST", path, {**body, "profile": "no-such"}), 404, "profile_not_found", "profile"
        )
    relu = attach("tiny-llama-L1-relu", 1)  # attaching locks the model
    profile_create(name="elsewhere", sae_id=relu.id, layer=2, steering={"1": 1.0})
    for path, body in generation.items():
        assert_openai_error(
            request(base, "POST", path, {**body, "profile": "elsewhere"}), 400, "profile_incompatible", "profile"
        )
    for path, body in BODIES.items():
        assert_openai_error(request(base, "POST", path, {**body, "model": "tiny-gpt2"}), 409, "model_locked", "model")
    model_id = Model.objects.get(name="tiny-llama").id
    request(llama.url, "POST", f"/api/models/{model_id}/unlock")
    grant = request(
        llama.url,
        "POST",
        f"/api/models/{model_id}/lease",
        {"holder": "errors-test", "reason": "param", "ttl_seconds": 60},
    )
    assert grant.status == 201, grant.body[:300]
    try:
        for path, body in BODIES.items():
            assert_openai_error(
                request(base, "POST", path, {**body, "model": "tiny-gpt2"}), 409, "model_leased", "model"
            )
    finally:
        request(
            llama.url,
            "DELETE",
            f"/api/models/{model_id}/lease",
            headers={"X-miLLM-Lease": grant.json()["data"]["lease_id"]},
        )
    # the input's own error keeps naming the input
    assert_openai_error(
        request(base, "POST", "/completions", {**BODIES["/completions"], "prompt": [5] * 600}),
        400,
        "context_length_exceeded",
        "prompt",
    )


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("GET", "/chat/completions", {"POST"}),
        ("PUT", "/completions", {"POST"}),
        ("DELETE", "/embeddings", {"POST"}),
        ("POST", "/models", {"GET"}),
        ("POST", "/models/tiny-llama", {"GET"}),
        ("PATCH", "/batches", {"GET", "POST"}),
    ],
)
def test_a_405_names_the_allowed_methods(llama, method, path, allow):
    resp = request(llama.base_url, method, path)
    assert_openai_error(resp, 405, "method_not_allowed")
    assert {m.strip() for m in resp.headers["allow"].split(",")} == allow  # RFC 9110
    # and a method it names is not a 405
    assert request(llama.base_url, sorted(allow)[0], path, {} if "POST" in allow else None).status != 405


def test_the_api_probe_score_405_names_post(llama):
    resp = request(llama.url, "GET", "/api/probes/score")
    assert resp.status == 405 and resp.headers["allow"] == "POST"
