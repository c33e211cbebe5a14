"""What a researcher does in the pages, checked where it lands: a hub download's progress
bar moves, a slider changes the live steering (read back through /api), the playground
streams tokens and draws one heat-strip cell per token, a circuit goes through the rung
gate only with the acknowledgement."""

from __future__ import annotations

import json
import time

from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.ui import documents
from tests.ui.conftest import SLOW_REPO, screenshot


def _steering(server) -> dict:
    return server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")


def test_download_progress_bar_moves(server, page):
    page.goto(server.url + "/models/")
    page.wait_for_selector("#models tr[data-model-id]")
    page.fill("#dl-repo", SLOW_REPO)
    page.select_option("#dl-quant", "FP32")
    page.click("#download-form button[type=submit]")
    bar = page.locator("tr:has(th:text-is('slow-llama')) progress")
    bar.wait_for()
    seen: list[float] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            value = float(bar.get_attribute("value", timeout=1000) or 0)
        except PlaywrightTimeout:  # the row re-rendered as ready: the bar is gone
            break
        if not seen or value != seen[-1]:
            seen.append(value)
        if len(seen) == 3:
            screenshot(page, "models-downloading")
        page.wait_for_timeout(100)
    # the bar moved through several values, never backwards, and the download ended ready
    assert len(seen) >= 3, seen
    assert seen == sorted(seen) and seen[-1] > seen[0], seen
    page.wait_for_selector("tr:has(th:text-is('slow-llama')) .badge:text-is('ready')", timeout=30_000)
    model = next(m for m in server.api("GET", "/api/models")["models"] if m["name"] == "slow-llama")
    assert model["status"] == "ready" and model["repo_id"] == SLOW_REPO
    page.console.assert_clean()


def test_lease_taken_renewed_and_released_from_the_models_page(server, page):
    resident = next(m for m in server.api("GET", "/api/models")["models"] if m["status"] == "loaded")
    page.goto(server.url + "/models/")
    page.wait_for_selector("#lease-badge .badge")
    page.fill("#lease-holder", "ui-test")
    page.fill("#lease-reason", "checking the lease form")
    page.fill("#lease-ttl", "5")
    page.click("#lease-take")
    page.wait_for_selector("#lease-badge .badge:text-is('leased')")
    lease = server.api("GET", f"/api/models/{resident['id']}/lease")["lease"]
    assert lease["holder"] == "ui-test" and lease["ttl_seconds"] == 300
    assert page.input_value("#lease-id").startswith("lease_")
    page.fill("#lease-ttl", "10")
    page.click("#lease-renew")
    page.wait_for_selector(".notice.ok:has-text('renewed')")
    assert server.api("GET", f"/api/models/{resident['id']}/lease")["lease"]["ttl_seconds"] == 600
    page.click("#lease-release")
    page.wait_for_selector("#lease-badge .badge:text-is('not leased')")
    assert server.api("GET", f"/api/models/{resident['id']}/lease")["lease"] is None
    page.console.assert_clean()


def test_slider_and_number_change_the_live_steering(server, page):
    server.api("DELETE", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")
    page.goto(server.url + "/steering/")
    page.wait_for_selector("#attachment option[value^=sae_]", state="attached")
    page.fill("#find", "5")
    page.press("#find", "Enter")
    slider = page.locator("#f-5-range")
    slider.focus()
    for _ in range(7):
        page.keyboard.press("ArrowRight")
    server.wait_for("feature 5 at 7", lambda: _steering(server)["values"].get("5") == 7.0, timeout=10, interval=0.1)
    state = _steering(server)
    assert state["enabled"] is True and state["values"] == {"5": 7.0}
    # the numeric input sets the same feature; the slider follows it
    page.fill("#f-5-value", "-42.5")
    page.press("#f-5-value", "Enter")
    server.wait_for(
        "feature 5 at -42.5", lambda: _steering(server)["values"].get("5") == -42.5, timeout=10, interval=0.1
    )
    assert (
        page.input_value("#f-5-range") == "-42.5" or float(page.input_value("#f-5-range")) == -42
    )  # a range input rounds to its step
    # a value outside the range is refused in the page and never sent
    page.fill("#f-5-value", "250")
    page.press("#f-5-value", "Enter")
    page.wait_for_selector(".notice.error")
    assert _steering(server)["values"] == {"5": -42.5}
    # disabling keeps the values and stops applying them
    page.uncheck("#enabled")
    server.wait_for("steering disabled", lambda: _steering(server)["enabled"] is False, timeout=10, interval=0.1)
    page.check("#enabled")
    server.wait_for("steering enabled", lambda: _steering(server)["enabled"] is True, timeout=10, interval=0.1)
    # save as a profile
    page.fill("#profile-name", "ui-saved")
    page.click("#save-form button[type=submit]")
    page.wait_for_selector(".notice.ok:has-text('ui-saved')")
    profile = next(p for p in server.api("GET", "/api/profiles")["profiles"] if p["name"] == "ui-saved")
    assert profile["steering"] == {"5": -42.5} and profile["sae_id"] == server.sae_id
    screenshot(page, "steering-set")
    # the refused 250 left one error notice but no console error
    page.console.assert_clean()
    server.api("DELETE", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")


def test_profile_imported_activated_and_dialled(server, page):
    page.goto(server.url + "/profiles/")
    page.wait_for_selector("tr[data-profile-id]")
    document = {**documents.PROFILE, "sae_id": server.sae_id}
    page.fill("#import-text", json.dumps(document))
    page.click("#import-form button[type=submit]")
    row = page.locator("tr:has(th:has-text('imported-profile'))")
    row.wait_for()
    profile = next(p for p in server.api("GET", "/api/profiles")["profiles"] if p["name"] == "imported-profile")
    assert profile["steering"] == {"4": 9.5, "9": -3.0} and profile["layer"] == 1
    row.locator("button:text-is('Activate')").click()
    server.wait_for(
        "the profile to be live", lambda: _steering(server)["values"] == {"4": 9.5, "9": -3.0}, timeout=10, interval=0.1
    )
    # the dial re-applies an active profile: values × λ
    row = page.locator("tr:has(th:has-text('imported-profile'))")
    row.locator(".badge:text-is('active')").wait_for()
    row.locator("input[type=number]").fill("2")
    row.locator("input[type=number]").press("Enter")
    server.wait_for(
        "the profile at λ 2", lambda: _steering(server)["values"] == {"4": 19.0, "9": -6.0}, timeout=10, interval=0.1
    )
    screenshot(page, "profiles-active")
    page.locator("tr:has(th:has-text('imported-profile')) button:text-is('Deactivate')").click()
    server.wait_for("the profile to end", lambda: not _steering(server)["enabled"], timeout=10)
    page.console.assert_clean()


RECORD_LENGTHS = """() => {
  window.__lengths = [];
  const node = document.querySelector('#transcript-steered');
  new MutationObserver(() => {
    const turns = node.querySelectorAll('.turn.assistant .text');
    const last = turns[turns.length - 1];
    if (last) window.__lengths.push(last.textContent.length);
  }).observe(node, {subtree: true, childList: true, characterData: true});
}"""


def test_playground_streams_side_by_side_with_a_heat_strip(server, page):
    page.goto(server.url + "/playground/")
    page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
    page.check("input[name=steer-mode][value=inline]")
    page.fill("#inline-features", "5: 60\n9: -40")
    page.fill("#max-tokens", "150")
    page.fill("#message", "Tell me about your weekend.")
    page.evaluate(RECORD_LENGTHS)
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#transcript-steered .heat-strip", timeout=60_000)
    page.wait_for_selector("#transcript-plain .heat-strip", timeout=60_000)
    lengths = page.evaluate("window.__lengths.filter((n) => n > 0)")
    # tokens arrived in pieces, the text only ever growing (at least three: a loaded CI
    # machine's browser may draw the rest of a fast stream in one go, as it once did after
    # 15 characters)
    assert len(set(lengths)) >= 3, lengths
    assert lengths == sorted(lengths), lengths

    steered = page.inner_text("#transcript-steered .turn.assistant .text")
    plain = page.inner_text("#transcript-plain .turn.assistant .text")
    cells = {col: page.locator(f"#transcript-{col} .heat-cell").count() for col in ("steered", "plain")}
    # the unsteered column is exactly what the same request answers without streaming
    status, reference = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 150,
            "temperature": 0,
            "seed": 0,
            "messages": [{"role": "user", "content": "Tell me about your weekend."}],
            "steering": {"features": []},
        },
        timeout=60,
    )
    assert status == 200
    assert plain == reference["choices"][0]["message"]["content"]
    # one cell per generated token
    assert cells["plain"] == reference["usage"]["completion_tokens"] > 0
    assert cells["steered"] > 0 and cells["steered"] == int(
        page.locator("#transcript-steered .heat-strip").get_attribute("data-cells")
    )
    # the left column really ran steered (and said so), so the answers differ
    assert steered != plain
    assert "inline" in page.inner_text("#transcript-steered .meta")
    # every cell carries its value for assistive technology and hover
    label = page.locator("#transcript-plain .heat-cell").first.get_attribute("aria-label")
    assert label.startswith("token 1 ") and "feature" in label
    screenshot(page, "playground-streamed")
    page.console.assert_clean()


def test_circuit_activation_needs_the_rung_acknowledgement(server, page):
    page.goto(server.url + "/circuits/")
    page.wait_for_selector("tr[data-circuit-id]")
    page.click("button[aria-label='Activate greeting-chain']")
    gate = page.locator("#gate")
    gate.wait_for()
    assert "UNVALIDATED_CIRCUIT" in gate.inner_text()
    assert page.locator("#diagram svg .node").count() == 4
    assert page.locator("#diagram svg path.edge").count() == 2
    assert server.api("GET", "/api/circuits/active")["total"] == 0
    assert page.locator("text=Activate anyway").is_disabled()
    page.check("#gate-consent")
    page.click("text=Activate anyway")
    page.wait_for_selector(".notice.ok:has-text('is serving')")
    active = server.api("GET", "/api/circuits/active")
    assert [c["name"] for c in active["circuits"]] == ["greeting-chain"]
    page.wait_for_selector("#claims tr:nth-child(2)")
    screenshot(page, "circuits-serving")
    page.click("button[aria-label='Deactivate greeting-chain']")
    server.wait_for("the circuit to stop", lambda: server.api("GET", "/api/circuits/active")["total"] == 0, timeout=15)
    page.console.assert_clean()
