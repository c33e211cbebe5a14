"""Every page renders against the running server without a console error, with its data
loaded and the event socket live; every form control has a label. Screenshots of each
page (1366×768, the whole page) are kept in test-artifacts/ui/."""

from __future__ import annotations

import pytest

from tests.ui.conftest import screenshot

PAGES = [
    # path, title, a selector that appears once the page's data is in
    ("/", "Dashboard", "#components tr:nth-child(3)"),
    ("/models/", "Models", "#models tr[data-model-id]"),
    ("/saes/", "SAEs", "#compat .badge"),
    ("/steering/", "Steering", "#results li"),
    ("/profiles/", "Profiles", "#profiles tr"),
    ("/clusters/", "Clusters", "tr[data-cluster-id]"),
    ("/circuits/", "Circuits", "tr[data-circuit-id]"),
    ("/playground/", "Playground", "#heat-sae option[value^=sae_]"),
    ("/monitoring/", "Monitoring", "#records tr"),
    ("/captures/", "Captures", "#captures tr"),
    ("/batches/", "Batches", "#batches tr"),
]

# Controls without a <label>, aria-label or aria-labelledby (hidden ones excepted).
UNLABELLED = """() => [...document.querySelectorAll('input, select, textarea')]
  .filter((c) => c.type !== 'hidden' && c.offsetParent !== null)
  .filter((c) => !(c.labels && c.labels.length) && !c.getAttribute('aria-label')
                 && !c.getAttribute('aria-labelledby'))
  .map((c) => c.outerHTML.slice(0, 120))"""


@pytest.mark.parametrize(("path", "title", "ready"), PAGES, ids=[p[1] for p in PAGES])
def test_page_renders_without_console_errors(server, page, path, title, ready):
    page.goto(server.url + path)
    assert page.inner_text("h1") == title
    page.wait_for_selector(ready, state="attached")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    assert page.locator("nav a[aria-current=page]").inner_text() == title
    assert page.evaluate(UNLABELLED) == []
    page.wait_for_timeout(300)  # late answers (events, polls) would log here
    screenshot(page, title.lower())
    page.console.assert_clean()


def test_dashboard_shows_the_resident_model_and_attachments(server, page):
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelector('#model-name').textContent === 'tiny-llama'")
    assert page.inner_text("#model-layers") == "4"
    row = page.locator("#attachments tr").first
    assert server.sae_id in row.inner_text() and "model.layers.1" in row.inner_text()
    assert page.locator("a[href='/admin/']").count() == 1
    page.console.assert_clean()


TOKENS_SHOWN = "Number(document.querySelector('#tok-total').textContent.replace(/\\D/g, ''))"


def test_dashboard_figures_follow_the_pushed_metrics(server, page):
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if "/api/health/metrics" in r.url else None)
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    page.wait_for_function("document.querySelector('#tok-total').textContent !== '—'")
    polled = len(polls)  # at most the one poll made before the socket opened
    status, body = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 6,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "figures"}],
        },
        timeout=60,
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    total = server.api("GET", "/api/health/metrics")["tokens_generated"]
    page.wait_for_function(f"{TOKENS_SHOWN} === {total}", timeout=10_000)  # no reload
    assert len(polls) == polled  # the figures came over the socket, not by polling
    page.console.assert_clean()


def test_keyboard_reaches_the_navigation_and_skip_link(server, page):
    page.goto(server.url + "/models/")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    page.console.assert_clean()


def test_models_page_hides_the_engines_panel_with_one_engine(server, page):
    (engine,) = server.api("GET", "/api/engines")["engines"]  # the premise: one engine
    page.goto(server.url + "/models/")
    # the report came and named one engine: the models table says it all
    page.locator("#engines-panel[data-state='one']").wait_for(state="attached")
    assert page.locator(f"#engines tr[data-engine='{engine['name']}']").count() == 1
    assert not page.locator("#engines-panel").is_visible()
    page.console.assert_clean()
