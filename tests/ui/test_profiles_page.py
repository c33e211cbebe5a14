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
    created = server.api("POST", "/api/profiles", {
        "name": "dup-check", "sae_id": server.sae_id, "layer": 1, "steering": {"3": 5}})
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
