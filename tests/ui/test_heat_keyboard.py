"""The heat strip from the keyboard, as its hint says: Tab reaches a strip (one stop per
strip), the arrow keys, Home and End move between its cells, and the focused cell's
values show below the strip."""

from __future__ import annotations

ACTIVE = """() => { const a = document.activeElement;
  return a && a.classList.contains('heat-cell')
    ? {index: [...a.parentElement.children].indexOf(a), label: a.getAttribute('aria-label'),
       column: a.closest('.transcript').id} : null; }"""


def test_heat_cells_are_reached_and_read_by_keyboard(server, page):
    page.goto(server.url + "/playground/")
    page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
    page.fill("#max-tokens", "5")
    page.fill("#message", "Keyboard")
    page.click("#send")
    page.wait_for_selector("#transcript-plain .heat-strip", timeout=60_000)
    page.wait_for_selector("#transcript-steered .heat-strip", timeout=60_000)
    count = page.locator("#transcript-steered .heat-cell").count()
    assert count >= 2
    labels = page.locator("#transcript-steered .heat-cell").evaluate_all(
        "cells => cells.map(c => c.getAttribute('aria-label'))"
    )
    # Tab from the top of the page until a cell has the focus
    page.locator("body").focus()
    reached = None
    for _ in range(80):
        page.keyboard.press("Tab")
        reached = page.evaluate(ACTIVE)
        if reached:
            break
    assert reached == {"index": 0, "label": labels[0], "column": "transcript-steered"}
    readout = page.locator("#transcript-steered .heat-readout")
    assert readout.inner_text() == labels[0]
    page.keyboard.press("ArrowRight")
    assert page.evaluate(ACTIVE)["index"] == 1 and readout.inner_text() == labels[1]
    page.keyboard.press("End")
    assert page.evaluate(ACTIVE)["index"] == count - 1
    assert readout.inner_text() == labels[count - 1]
    page.keyboard.press("ArrowRight")  # stays on the last cell
    assert page.evaluate(ACTIVE)["index"] == count - 1
    page.keyboard.press("Home")
    assert page.evaluate(ACTIVE)["index"] == 0
    # the strip is one Tab stop: the next Tabs go through the focused token's "open its
    # dashboard" links (one per feature of that token), then to the other column's strip
    links = page.locator("#transcript-steered .heat-features a").count()
    assert links >= 1
    for _ in range(links):
        page.keyboard.press("Tab")
        assert page.evaluate("() => document.activeElement.classList.contains('feature-link')")
    page.keyboard.press("Tab")
    assert page.evaluate(ACTIVE) == {
        "index": 0,
        "column": "transcript-plain",
        "label": page.locator("#transcript-plain .heat-cell").first.get_attribute("aria-label"),
    }
    page.console.assert_clean()
