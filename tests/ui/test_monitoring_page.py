"""The monitoring page's live panel follows the events: the features of a monitored
generation with their labels from the SAE's feature_labels.json, the most frequent ones
counted in whole numbers, and the count of kept records, all without a reload."""

from __future__ import annotations

import json
import shutil

MESSAGE = "Monitor this."


def test_live_features_have_labels_counts_and_the_kept_total(server, page, tiny_assets, tmp_path):
    folder = tmp_path / "labelled-monitor"
    shutil.copytree(tiny_assets.saes["tiny-llama-L1-relu"].path, folder)
    d_sae = 256
    (folder / "feature_labels.json").write_text(json.dumps({str(i): f"feat-{i}" for i in range(d_sae)}))
    sae = server.api("POST", "/api/saes", {"source": "local", "local_path": str(folder), "name": "labelled-monitor"})[
        "sae_id"
    ]
    server.api("POST", f"/api/saes/{sae}/attach", {"layer": 2})
    before = server.api("GET", "/api/monitoring")
    try:
        server.api(
            "POST",
            "/api/monitoring/configure",
            {
                "enabled": True,
                "top_k": 3,
                "positions": "completion",
                "history_size": 100,
                "sae_id": sae,
                "layer": 2,
                "features": None,
            },
        )
        page.goto(server.url + "/monitoring/")
        page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
        page.wait_for_selector("#h-note:has-text('record(s) kept')")
        status, _ = server.call(
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny-llama",
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": MESSAGE}],
            },
            timeout=60,
        )
        assert status == 200
        kept = server.api("GET", "/api/monitoring")["history_count"]
        assert kept > 0
        page.wait_for_selector("#window-n:text-is('1')")  # the event arrived
        top = page.locator("#live-top li")
        assert top.count() == 3
        for i in range(3):
            index = top.nth(i).get_attribute("data-feature")
            assert top.nth(i).locator(".feature-label").inner_text() == f"feat-{index}"
        # one generation in the window: each of its features counted once, as a count
        freq = page.locator("#live-freq li")
        assert freq.count() == 3
        assert freq.locator(".num").all_inner_texts() == ["1", "1", "1"]
        assert freq.first.locator(".feature-label").inner_text().startswith("feat-")
        page.wait_for_selector(f"#h-note:text-is('{kept} record(s) kept (at most 100)')", timeout=10_000)
    finally:
        server.api(
            "POST",
            "/api/monitoring/configure",
            {
                "enabled": before["enabled"],
                "top_k": before["top_k"],
                "positions": before["positions"],
                "history_size": before["history_size"],
                "sae_id": before["sae_id"],
                "layer": before["layer"],
                "features": before["monitored_features"],
            },
        )
        server.api("POST", f"/api/saes/{sae}/detach", {"layer": 2})
        server.api("DELETE", f"/api/saes/{sae}")
    page.console.assert_clean()
