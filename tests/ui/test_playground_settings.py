"""The playground's side panel does what it says: λ dials the live steering too (as
docs/api-v1.md has `steering_intensity` do), and a number outside a field's range is
refused in the page, naming the field, instead of being replaced or sent."""

from __future__ import annotations

import json

import pytest

from tests.ui.conftest import direct_chat

MESSAGE = "Tell me about the sea."


def _ready(page, server) -> None:
    page.goto(server.url + "/playground/")
    page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")


def _bodies(page) -> list[dict]:
    bodies: list[dict] = []
    page.on(
        "request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None
    )
    return bodies


def _answer(page, column: str) -> str:
    selector = f"#transcript-{column} .turn.assistant:not(.streaming) .meta"
    page.wait_for_function(
        f"[...document.querySelectorAll('{selector}')].some(m => m.textContent.includes('tokens in'))", timeout=60_000
    )
    return page.locator(f"#transcript-{column} .turn.assistant .text").last.inner_text()


def _direct(server, **extra) -> str:
    return direct_chat(server, MESSAGE, **extra)


def test_lambda_dials_the_live_steering(server, page):
    sae = server.sae_id
    server.api("POST", "/api/saes/steering", {"sae_id": sae, "layer": 1, "feature_idx": 1, "value": 20})
    try:
        # the live steering changes this answer (the positive control), and λ = 0.5
        # changes it again: the page must send λ for the answer to be the half-steered one
        full, half = _direct(server), _direct(server, steering_intensity=0.5)
        plain = _direct(server, steering={"features": []})
        assert len({full, half, plain}) == 3, (full, half, plain)
        bodies = _bodies(page)
        _ready(page, server)
        page.uncheck("#compare")
        page.fill("#max-tokens", "6")
        page.locator("#intensity").focus()
        for _ in range(10):  # 1.00 → 0.50 in steps of 0.05
            page.keyboard.press("ArrowLeft")
        assert page.inner_text("#intensity-out") == "0.50"
        page.fill("#message", MESSAGE)
        page.click("#send")
        assert _answer(page, "steered") == half
        assert bodies[-1]["steering_intensity"] == 0.5 and "steering" not in bodies[-1]
        assert "live;" in page.inner_text("#transcript-steered .meta")
    finally:
        server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    page.console.assert_clean()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("#max-tokens", "0", "Max tokens must be a whole number from 1 to 4096 (it is “0”)"),
        ("#max-tokens", "5000", "Max tokens must be a whole number from 1 to 4096 (it is “5000”)"),
        ("#max-tokens", "2.5", "Max tokens must be a whole number from 1 to 4096 (it is “2.5”)"),
        ("#max-tokens", "", "Max tokens must be a whole number from 1 to 4096 (it is empty)"),
        ("#temperature", "3", "Temperature must be from 0 to 2 (it is “3”)"),
        ("#seed", "-1", "Seed must be a whole number 0 or more (it is “-1”)"),
    ],
)
def test_a_setting_out_of_range_is_refused_in_the_page(server, page, field, value, message):
    bodies = _bodies(page)
    _ready(page, server)
    page.fill(field, value)
    page.fill("#message", MESSAGE)
    page.click("#send")
    error = page.locator(".notice.error")
    error.wait_for()
    assert error.locator("span").inner_text() == f"Settings: {message}"
    assert page.get_attribute(field, "aria-invalid") == "true"
    assert bodies == [] and page.input_value("#message") == MESSAGE  # nothing sent
    # corrected, the same message goes out with the value as typed
    page.fill("#max-tokens", "2")
    page.fill("#temperature", "0")
    page.fill("#seed", "")
    page.click("#send")
    _answer(page, "plain")
    assert [(b["max_tokens"], b["temperature"], b["seed"]) for b in bodies] == [(2, 0, 0)] * 2
    assert page.get_attribute(field, "aria-invalid") is None
