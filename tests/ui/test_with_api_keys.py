"""With API keys set (here an admin key, as an operator has) the pages still load (they
hold no data), ask for the key without sending a single refused request, keep it in
sessionStorage and send it."""

from __future__ import annotations

import pytest

from tests.ui.conftest import screenshot, start_server, stop_server

KEY = "ui-test-key-0123456789"


@pytest.fixture(scope="module")
def keyed_server(tiny_assets, slow_hub, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("ui-keys"), slow_hub.url, {"MILLM_ADMIN_API_KEYS": KEY})
    yield srv
    stop_server(srv)


def test_pages_ask_for_the_key_then_use_it(keyed_server, page):
    page.goto(keyed_server.url + "/models/")
    dialog = page.locator("#api-key-dialog")
    dialog.wait_for(state="visible")
    assert "requires a key" in page.inner_text("#api-key-state")
    assert "API key needed" in page.inner_text("#ws-status")
    screenshot(page, "api-key-dialog")
    page.fill("#api-key-input", KEY)
    with page.expect_navigation():
        page.click("#api-key-form button[value=save]")
    page.wait_for_selector("#models tr[data-model-id]")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    assert page.evaluate("sessionStorage.getItem('millm.apiKey')") == KEY
    assert not page.locator("#api-key-dialog").is_visible()
    page.console.assert_clean()
