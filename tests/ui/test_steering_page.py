"""The steering page shows what the server holds: a refused value is replaced by the one
still running, not left in the box."""

from __future__ import annotations


def _steering(server) -> dict:
    return server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")


def _open(server, page) -> None:
    page.goto(server.url + "/steering/")
    page.wait_for_selector("#attachment option[value^=sae_]", state="attached")


def test_a_refused_value_gives_way_to_the_server_value(server, page):
    sae = server.sae_id
    server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    server.api("POST", "/api/saes/steering", {"sae_id": sae, "layer": 1, "feature_idx": 5,
                                              "value": 10})
    try:
        _open(server, page)
        page.wait_for_selector("#f-5-value")
        assert page.input_value("#f-5-value") == "10"
        for refused in ("250", "-200.5", ""):
            page.fill("#f-5-value", refused)
            page.press("#f-5-value", "Enter")
            error = page.locator(".notice.error").last
            error.wait_for()
            # the box and the slider show what runs, which the server still holds
            assert (page.input_value("#f-5-value"), page.input_value("#f-5-range")) == ("10", "10")
            assert "it stays at 10" in error.inner_text()
            assert _steering(server)["values"] == {"5": 10.0}
            page.click(".notice.error button")
    finally:
        server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    page.console.assert_clean()
