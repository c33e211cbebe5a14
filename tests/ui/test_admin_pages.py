"""The admin in Chromium: its pages ask for nothing the server does not have (the
browser's own /favicon.ico request was a 404 on every admin page)."""

from __future__ import annotations


def test_admin_login_loads_without_a_failed_request(server, page):
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(server.url + "/admin/login/")
    page.wait_for_load_state("networkidle")
    assert page.title() == "Log in | miLLM admin"
    assert failed == []
    page.console.assert_clean()
