"""The profiles page says what a profile holds: two rows for one feature are flagged
before anything is saved (they would merge into one key, the last row winning)."""

from __future__ import annotations


def _profile(server, name: str) -> dict:
    return next(p for p in server.api("GET", "/api/profiles")["profiles"] if p["name"] == name)


def _row(page, index: str, strength: str) -> None:
    page.click("#p-add")
    row = page.locator("#p-features li").last
    row.locator(".p-index").fill(index)
    row.locator(".p-strength").fill(strength)


def test_duplicate_feature_rows_are_flagged_and_not_saved(server, page):
    created = server.api(
        "POST", "/api/profiles", {"name": "dup-check", "sae_id": server.sae_id, "layer": 1, "steering": {"3": 5}}
    )
    try:
        page.goto(server.url + "/profiles/")
        page.locator("tr:has(th:has-text('dup-check')) button:text-is('Edit')").click()
        page.wait_for_selector("#p-features li .p-index")
        _row(page, "7", "2")
        _row(page, "3", "-9")  # feature 3 again
        page.click("#p-save")
        error = page.locator(".notice.error")
        error.wait_for()
        assert "Feature 3 is listed 2 times" in error.inner_text()
        assert "Nothing was saved" in error.inner_text()
        flagged = page.locator("#p-features .p-index[aria-invalid=true]")
        assert [flagged.nth(i).input_value() for i in range(flagged.count())] == ["3", "3"]
        assert _profile(server, "dup-check")["steering"] == {"3": 5.0}
        # one row per feature: saved as shown
        page.locator("#p-features li").last.locator("button").click()
        page.click("#p-save")
        page.wait_for_selector(".notice.ok:has-text('Saved dup-check')")
        assert _profile(server, "dup-check")["steering"] == {"3": 5.0, "7": 2.0}
        assert page.locator("#p-features .p-index[aria-invalid=true]").count() == 0
    finally:
        server.api("DELETE", f"/api/profiles/{created['id']}")


def test_a_profile_shows_its_controls(server, page):
    sae = server.sae_id
    server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    server.api(
        "POST",
        "/api/saes/steering",
        {"sae_id": sae, "layer": 1, "feature_idx": 9, "mode": "clamp", "value": 3, "phase": "completion"},
    )
    try:
        # saved from the Steering page: the notice counts the control
        page.goto(server.url + "/steering/")
        page.wait_for_selector("#controls li[data-index='9']")
        page.fill("#profile-name", "with-control")
        page.click("#save-form button[type=submit]")
        ok = page.locator(".notice.ok:has-text('with-control')")
        ok.wait_for()
        stored = _profile(server, "with-control")
        assert stored["steering"] == {} and len(stored["controls"]) == 1
        assert "(0 values, 1 control)" in ok.inner_text()
        # the list counts it, the editor lists it, and a save keeps it
        page.goto(server.url + "/profiles/")
        row = page.locator("tr:has(th:has-text('with-control'))")
        assert row.locator("td.num").inner_text() == "0 values, 1 control"
        row.locator("button:text-is('Edit')").click()
        listed = page.locator("#p-controls li[data-index='9'][data-mode='clamp']")
        assert listed.inner_text() == "#9 clamp · 3 · in the completion"
        _row(page, "4", "6")
        page.fill("#p-desc", "edited")
        page.click("#p-save")
        page.wait_for_selector(".notice.ok:has-text('Saved with-control')")
        saved = _profile(server, "with-control")
        assert saved["steering"] == {"4": 6.0} and saved["controls"] == stored["controls"]
        # the list is drawn again after the save's notice: wait for it, not a fixed moment
        page.wait_for_selector("tr:has(th:has-text('with-control')) td.num:text-is('1 value, 1 control')")
    finally:
        server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
        server.api("DELETE", f"/api/profiles/{_profile(server, 'with-control')['id']}")
    page.console.assert_clean()
