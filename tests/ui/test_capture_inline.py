"""An inline capture (a /v1 answer carrying the artifact itself) is said to be what it is:
shown in the page and not stored, never "kept until deleted". The UI server stores every
capture, so the page is handed the inline form of a stored one: the same file, base64 in
the answer, as a server with a larger CAPTURE_INLINE_MAX_BYTES sends it."""

from __future__ import annotations

import base64

from tests.ui.test_captures import _download, _store_capture


def test_an_inline_capture_is_not_called_kept(server, page):
    capture_id, _ = _store_capture(server, "inline", {"layers": [0, 1], "positions": "last"})
    status, answer = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 3,
            "temperature": 0,
            "messages": [{"role": "user", "content": "inline"}],
            "capture": {"layers": [0, 1], "positions": "last"},
        },
        timeout=60,
    )
    assert status == 200
    stored = answer["millm"]["capture"]
    # the inline form (docs/capture.md): {id, inline: true, format, bytes, data, metadata}
    answer["millm"]["capture"] = {
        "id": stored["id"],
        "inline": True,
        "format": stored["format"],
        "bytes": stored["bytes"],
        "data": base64.b64encode(_download(server, stored["id"])).decode(),
        "metadata": server.api("GET", f"/api/captures/{stored['id']}")["metadata"],
    }
    page.route("**/v1/chat/completions", lambda route: route.fulfill(json=answer))
    page.goto(server.url + "/captures/")
    page.wait_for_selector("#c-model option[value='tiny-llama']", state="attached")
    page.wait_for_function("document.querySelector('#c-layers').value === '0, 1, 2, 3'")
    page.fill("#c-layers", "0, 1")
    page.fill("#c-prompt", "inline")
    page.click("#c-send")
    page.wait_for_selector(f"#detail[data-state=ready][data-capture-id='{stored['id']}']")
    assert "inline (at most CAPTURE_INLINE_MAX_BYTES: shown, not stored)" in page.inner_text("#c-result")
    note = page.inner_text("#detail-note")
    assert note.endswith(" · not stored: gone on reload"), note
    assert "kept until deleted" not in note and "expires" not in note
    # a stored one still says how long it is kept
    page.locator(f"#captures tr[data-capture-id='{capture_id}'] button", has_text="Open").click()
    page.wait_for_selector(f"#detail[data-state=ready][data-capture-id='{capture_id}']")
    assert "not stored" not in page.inner_text("#detail-note")
