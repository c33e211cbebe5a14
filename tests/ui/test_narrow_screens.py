"""The pages on a phone-sized screen (390×844): one column, nothing wider than the screen
but inside a panel that scrolls, and the playground's message box and Send button usable;
a long steering description under a steered answer wraps instead of being cut off."""

from __future__ import annotations

import pytest

from tests.ui.conftest import screenshot

NARROW = {"width": 390, "height": 844}

# What sticks out of the page on the right, outside any element that scrolls sideways.
OUTSIDE = """() => {
  const width = document.documentElement.clientWidth;
  const scrolls = (e) => { for (let p = e.parentElement; p; p = p.parentElement) {
    if (['auto', 'scroll'].includes(getComputedStyle(p).overflowX)) return true; } return false; };
  return [...document.querySelectorAll('main *')]
    .filter((e) => e.offsetParent !== null && e.getBoundingClientRect().right > width + 1 && !scrolls(e))
    .map((e) => e.tagName + '#' + e.id + '.' + e.className).slice(0, 5);
}"""


@pytest.fixture
def narrow(browser):
    context = browser.new_context(viewport=NARROW)
    context.set_default_timeout(15_000)
    page = context.new_page()
    yield page
    context.close()


def _fits(page) -> None:
    assert page.evaluate(OUTSIDE) == []
    assert page.evaluate("document.documentElement.scrollWidth") == NARROW["width"]


def test_playground_is_usable_on_a_phone(server, narrow):
    narrow.goto(server.url + "/playground/")
    narrow.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
    _fits(narrow)
    # the settings go below the chat: the message box spans the screen, less the margins
    for selector in ("#message", "#transcript-steered", "#transcript-plain", "#model"):
        box = narrow.locator(selector).bounding_box()
        assert box["width"] > NARROW["width"] - 80 and box["x"] >= 0, (selector, box)
    narrow.locator("#send").scroll_into_view_if_needed()
    send = narrow.locator("#send").bounding_box()
    on_top = narrow.evaluate(
        "([x, y]) => document.elementFromPoint(x, y)?.id",
        [send["x"] + send["width"] / 2, send["y"] + send["height"] / 2],
    )
    assert on_top == "send"
    screenshot(narrow, "narrow-playground")


@pytest.mark.parametrize(
    "path, ready",
    [
        ("/", "#attachments tr"),
        ("/monitoring/", "#requests li"),
        ("/circuits/", "tr[data-circuit-id]"),
    ],
)
def test_tables_scroll_inside_their_panel(server, narrow, path, ready):
    narrow.goto(server.url + path)
    narrow.wait_for_selector(ready)
    if path == "/monitoring/":
        narrow.locator("#requests li button").first.click()  # a request's records table
        narrow.wait_for_selector("#records tr td")
    if path == "/circuits/":
        narrow.click("#ce-add-member")
        narrow.click("#ce-add-sae")
    _fits(narrow)
    screenshot(narrow, "narrow-" + (path.strip("/") or "dashboard"))


def test_a_long_steering_description_wraps(server, page):
    # two columns side by side on a laptop screen: the description is wider than one
    sae = server.sae_id
    server.api("POST", "/api/saes/steering", {"sae_id": sae, "layer": 1, "feature_idx": 3, "value": 4})
    try:
        page.goto(server.url + "/playground/")
        page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
        page.fill("#max-tokens", "3")
        page.fill("#message", "wrap")
        page.click("#send")
        meta = page.locator("#transcript-steered .turn.assistant .meta").first
        page.wait_for_function("document.querySelector('#transcript-steered .meta').textContent.includes('hash')")
        text = meta.inner_text()
        # the whole description is there (the hash's 64 hex digits and its closing quote)
        assert f"sae={sae}" in text and text.rstrip().endswith('"'), text
        transcript = page.locator("#transcript-steered")
        assert transcript.evaluate("t => t.scrollWidth <= t.clientWidth")
        assert meta.bounding_box()["height"] > 30  # wrapped onto more than one line
    finally:
        server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
