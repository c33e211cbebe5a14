"""The steering page shows what the server holds: a refused value is replaced by the one
still running, not left in the box; browsing lists every feature of the SAE, the
labelled ones first."""

from __future__ import annotations

import json
import shutil


def _steering(server) -> dict:
    return server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")


def _open(server, page) -> None:
    page.goto(server.url + "/steering/")
    page.wait_for_selector("#attachment option[value^=sae_]", state="attached")


def test_a_refused_value_gives_way_to_the_server_value(server, page):
    sae = server.sae_id
    server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    server.api("POST", "/api/saes/steering", {"sae_id": sae, "layer": 1, "feature_idx": 5, "value": 10})
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


def test_browse_lists_every_feature_labelled_first(server, page, tiny_assets, tmp_path):
    folder = tmp_path / "labelled-sae"
    shutil.copytree(tiny_assets.saes["tiny-llama-L1-relu"].path, folder)
    labels = {"5": "ocean", "200": "formal register"}
    (folder / "feature_labels.json").write_text(json.dumps(labels))
    sae = server.api("POST", "/api/saes", {"source": "local", "local_path": str(folder), "name": "labelled-ui"})[
        "sae_id"
    ]
    server.api("POST", f"/api/saes/{sae}/attach", {"layer": 2})
    try:
        d_sae = next(a["d_sae"] for a in server.api("GET", "/api/saes/attachments")["entries"] if a["sae_id"] == sae)
        order = [5, 200] + [i for i in range(d_sae) if i not in (5, 200)]
        pages = -(-d_sae // 12)
        _open(server, page)
        page.select_option("#attachment", f"{sae}@2")
        page.wait_for_selector("#labels-note:has-text('2 labelled features')")

        def shown() -> list[int]:
            return [int(t.lstrip("#")) for t in page.locator("#results li .index").all_inner_texts()]

        assert shown() == order[:12]
        assert page.inner_text("#browse-note") == f"labelled first · page 1 of {pages}"
        assert page.locator("#results li .label").first.inner_text() == "ocean"
        page.click("#browse-next")
        assert shown() == order[12:24]
        for _ in range(pages):
            if page.is_disabled("#browse-next"):
                break
            page.click("#browse-next")
        assert shown() == order[12 * (pages - 1) :]
        assert shown()[-1] == d_sae - 1
        assert page.inner_text("#browse-note") == f"labelled first · page {pages} of {pages}"
    finally:
        server.api("POST", f"/api/saes/{sae}/detach", {"layer": 2})
        server.api("DELETE", f"/api/saes/{sae}")
    page.console.assert_clean()


def test_a_refusal_is_said_once(server, page):
    """The envelope's message already quotes its field's message; the notice says it once."""
    body = {"sae_id": server.sae_id, "layer": 1, "feature_idx": 8, "mode": "clamp"}
    status, out = server.call("POST", "/api/saes/steering", body)
    assert status == 422
    error = out["error"]
    [field_message] = error["details"]["fields"]["value"]
    assert field_message in error["message"]  # what the page must not repeat
    _open(server, page)
    box = page.locator("#control-editor fieldset.control")
    box.locator("[name=index]").fill("8")
    box.locator("[name=mode]").select_option("clamp")
    page.click("#control-set")
    shown = page.locator(".notice.error span").first
    shown.wait_for()
    assert shown.inner_text() == f"Set control: {error['code']}: {error['message']}"
    assert shown.inner_text().count(field_message) == 1
