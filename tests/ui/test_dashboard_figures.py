"""The dashboard's figures follow the server without a reload: an attachment's steered
passes after a steered generation, and the /v1 request count, which static files and
the admin do not move."""

from __future__ import annotations

import time

PASSES = "(document.querySelector('#attachments tr td.num')?.textContent ?? '').replace(/\\D/g, '')"


def _passes(server) -> int:
    metrics = server.api("GET", "/api/health/metrics")
    [row] = [a for a in metrics["steering_apply_count"] if a["sae_id"] == server.sae_id]
    return row["steering_apply_count"]


def test_steered_passes_follow_a_generation_without_a_reload(server, page):
    sae = server.sae_id
    server.api("POST", "/api/saes/steering", {"sae_id": sae, "layer": 1, "feature_idx": 2, "value": 5})
    try:
        page.goto(server.url + "/")
        page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
        page.wait_for_function(f"{PASSES} !== ''")
        before = int(page.evaluate(PASSES))
        assert before == _passes(server)
        loaded = time.monotonic()
        status, _ = server.call(
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny-llama",
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "passes"}],
            },
            timeout=60,
        )
        assert status == 200
        after = _passes(server)
        assert after > before  # the positive control: the generation was steered
        # well before the dashboard's own 15 s refresh
        page.wait_for_function(f"Number({PASSES}) === {after}", timeout=8_000)
        assert time.monotonic() - loaded < 14
    finally:
        server.api("DELETE", f"/api/saes/steering?sae_id={sae}&layer=1")
    page.console.assert_clean()


V1 = "document.querySelector('#req-v1').textContent.replace(/\\D/g, '')"


def test_request_figure_counts_v1_only(server, page):
    page.goto(server.url + "/")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    page.wait_for_function(f"{V1} !== ''")
    assert "/v1 requests" in page.inner_text("#load-h ~ dl")
    # a page, its static files and the admin's login are requests too, but not /v1 ones
    for path in ("/models/", "/static/ui/css/ui.css", "/admin/login/"):
        assert server.call("GET", "/api/health")[0] == 200
        page.context.request.get(server.url + path)
    status, _ = server.call(
        "POST",
        "/v1/chat/completions",
        {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "count me"}]},
        timeout=60,
    )
    assert status == 200
    metrics = server.api("GET", "/api/health/metrics")["requests"]
    v1 = metrics["by_surface"]["v1"]
    assert metrics["total"] > v1  # the counter holds the other requests too
    page.wait_for_function(f"Number({V1}) === {v1}", timeout=10_000)
    page.console.assert_clean()
