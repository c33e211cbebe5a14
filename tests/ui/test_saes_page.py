"""The attach form does not offer an attach the server would refuse: at a layer where the
chosen SAE already hooks it says so and keeps Attach disabled (the compatibility route
judges shapes, not attachments, and answers "compatible" there)."""

from __future__ import annotations


def test_attach_is_not_offered_where_the_sae_already_hooks(server, page):
    sae = server.sae_id
    attached = server.api("GET", "/api/saes/attachments")["entries"]
    assert (sae, 1) in [(a["sae_id"], a["layer"]) for a in attached]
    assert (sae, 2) not in [(a["sae_id"], a["layer"]) for a in attached]
    # what the page must not contradict: the route says compatible, the attach is refused
    assert server.api("GET", f"/api/saes/{sae}/compatibility?layer=1")["compatible"] is True
    status, out = server.call("POST", f"/api/saes/{sae}/attach", {"layer": 1})
    assert status == 409 and out["error"]["code"] == "SAE_ALREADY_ATTACHED"

    page.goto(server.url + "/saes/")
    page.wait_for_selector("#compat .badge")
    page.select_option("#attach-sae", sae)
    page.select_option("#attach-layer", "1")
    page.wait_for_selector("#compat .badge:text-is('already attached here')")
    assert "already attached at layer 1 (model.layers.1)" in page.inner_text("#compat")
    assert page.is_disabled("#attach-button")
    # another layer is checked by the server as before, and offered
    page.select_option("#attach-layer", "2")
    page.wait_for_selector("#compat .badge:text-is('compatible')")
    assert page.is_enabled("#attach-button")
    page.select_option("#attach-layer", "1")
    page.wait_for_selector("#compat .badge:text-is('already attached here')")
    assert page.is_disabled("#attach-button")
    page.console.assert_clean()
