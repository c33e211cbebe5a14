"""Steering controls in the pages (issue 19): the playground sends clamp and conditional
controls and shows, token by token, where the conditional one fired — checked against
the same request sent straight to /v1 by the test, never against the page's own code;
a bad control shows the server's refusal; attachments show their hook point and hooked
module; a circuit created and edited in the page is what /api/circuits returns."""

from __future__ import annotations

from tests.ui.conftest import screenshot

MESSAGE = "Tell me about the sea."
MAX_TOKENS = 24


def _base_body(server) -> dict:
    """What the playground sends for MESSAGE with its defaults (seed 0, greedy, logprobs
    and the heat strip's activations), minus the steering."""
    return {
        "model": "tiny-llama",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 0,
        "messages": [{"role": "user", "content": MESSAGE}],
        "logprobs": True,
        "return_sae_activations": {"sae_id": server.sae_id, "top_k": 3, "positions": "completion"},
    }


def _trigger(server) -> int:
    """A feature of the attached SAE that is active at some completion rows of the
    unsteered answer and not at others, so a condition on it fires at some tokens only."""
    status, out = server.call(
        "POST",
        "/v1/chat/completions",
        {
            **_base_body(server),
            "steering": {"features": []},
            "return_sae_activations": {
                "sae_id": server.sae_id,
                "top_k": 1,
                "positions": "completion",
                "read_point": "pre_steering",
                "features": list(range(256)),
            },
        },
        timeout=60,
    )
    assert status == 200, out
    rows = out["millm"]["sae_activations"]["positions"]
    active = {i: sum(1 for r in rows if r["features"][i]["activation"] > 0) for i in range(256)}
    best = min(active, key=lambda i: (abs(active[i] - len(rows) / 2), i))
    assert 0 < active[best] < len(rows), active[best]
    return best


def _open_playground(server, page):
    page.goto(server.url + "/playground/")
    page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
    page.check("input[name=steer-mode][value=inline]")
    page.uncheck("#compare")
    page.fill("#max-tokens", str(MAX_TOKENS))


def _control(page, n: int, **fields):
    page.click("#add-control")
    box = page.locator("#controls fieldset.control").nth(n)
    box.wait_for()
    for name, value in fields.items():
        target = box.locator(f"[name={name}]")
        if name in ("mode", "phase"):
            target.select_option(value)
        else:
            target.fill(str(value))


def test_playground_shows_where_conditional_steering_fired(server, page):
    trigger = _trigger(server)
    controls = [
        {"index": 5, "mode": "clamp", "value": 30, "phase": "completion"},
        {"index": 7, "mode": "add", "value": 40, "condition": {"feature": trigger, "threshold": 0}},
    ]
    status, reference = server.call(
        "POST", "/v1/chat/completions", {**_base_body(server), "steering": {"features": controls}}, timeout=60
    )
    assert status == 200, reference
    millm = reference["millm"]
    fired = [f for f in millm["steering_fired"] if f["choice"] == 0]
    expected_tokens = sorted({t for f in fired for t in f["token_indices"]})
    assert [f["index"] for f in fired] == [7] and expected_tokens  # it fired somewhere
    assert len(expected_tokens) < reference["usage"]["completion_tokens"]  # …not everywhere

    _open_playground(server, page)
    _control(page, 0, index=5, mode="clamp", value=30, phase="completion")
    _control(page, 1, index=7, mode="add", value=40, **{"cond-feature": trigger, "cond-threshold": 0})
    page.fill("#message", MESSAGE)
    page.click("#send")
    report = page.locator("#transcript-steered .steering-report")
    report.wait_for(timeout=60_000)

    # the same text the API answered for the same request
    assert page.inner_text("#transcript-steered .turn.assistant .text") == reference["choices"][0]["message"]["content"]
    # exactly the fired token indices the API reports are highlighted
    shown = [
        int(i)
        for i in page.eval_on_selector_all(
            "#transcript-steered .fired-tok.fired", "(n) => n.map((x) => x.dataset.tokenIndex)"
        )
    ]
    assert shown == expected_tokens
    assert page.locator("#transcript-steered .fired-tok").count() == reference["usage"]["completion_tokens"]
    legend = page.locator("#transcript-steered .fired-control")
    assert legend.count() == len(fired)
    assert legend.first.get_attribute("data-token-indices") == ",".join(str(t) for t in fired[0]["token_indices"])
    assert legend.first.get_attribute("data-positions") == ",".join(str(p) for p in fired[0]["positions"])
    # per-mode counts and the hash, as the API reports them
    modes = dict(
        page.eval_on_selector_all(
            "#transcript-steered .mode-count", "(n) => n.map((x) => [x.dataset.mode, Number(x.dataset.count)])"
        )
    )
    assert modes == millm["steering_apply_count"][0]["modes"] and {"clamp", "add"} <= set(modes)
    assert page.inner_text("#transcript-steered .steering-hash") == millm["steering"]["hash"]
    screenshot(page, "playground-conditional")
    page.console.assert_clean()


def test_a_bad_control_shows_the_servers_refusal(server, page):
    bad = [{"index": 5, "mode": "clamp", "value": 3, "condition": {"feature": 9999, "threshold": 0}}]
    status, refusal = server.call(
        "POST", "/v1/chat/completions", {**_base_body(server), "steering": {"features": bad}}, timeout=60
    )
    assert status == 400, refusal
    error = refusal["error"]

    _open_playground(server, page)
    _control(page, 0, index=5, mode="clamp", value=3, **{"cond-feature": 9999, "cond-threshold": 0})
    page.fill("#message", MESSAGE)
    page.click("#send")
    shown = page.locator("#transcript-steered .meta .status-text.bad")
    shown.wait_for(timeout=60_000)
    assert error["code"] in shown.inner_text() and error["message"] in shown.inner_text()
    alert = page.locator(".notice.error").first
    alert.wait_for()
    assert error["message"] in alert.inner_text()
    # the refused request left no answer and no report behind
    assert page.locator("#transcript-steered .steering-report").count() == 0
    # the refusal (a 400 from fetch) logs a network error line and nothing else
    assert all("400" in e for e in page.console.errors), page.console.errors


def test_attachments_show_their_hook_point_and_module(server, page):
    entries = server.api("GET", "/api/saes/attachments")["entries"]
    mine = next(e for e in entries if e["sae_id"] == server.sae_id and e["layer"] == 1)
    assert (mine["hook_point"], mine["layer_module_path"]) == ("resid_post", "model.layers.1")

    page.goto(server.url + "/saes/")
    cell = page.locator(f"tr[data-sae-id='{server.sae_id}'] .attached-at")
    cell.wait_for()
    assert mine["hook_point"] in cell.inner_text()
    assert mine["layer_module_path"] in cell.inner_text()

    page.goto(server.url + "/steering/")
    page.wait_for_selector("#hook code")
    assert page.inner_text("#hook .badge") == mine["hook_point"]
    assert page.inner_text("#hook code") == mine["layer_module_path"]
    page.console.assert_clean()


def _member(page, n: int, layer, feature, strength, label="", sign="1"):
    row = page.locator("#ce-members tr.ce-member").nth(n)
    row.locator("[name=layer]").fill(str(layer))
    row.locator("[name=feature]").fill(str(feature))
    row.locator("[name=strength]").fill(str(strength))
    row.locator("[name=sign]").select_option(sign)
    row.locator("[name=label]").fill(label)


def _circuits_named(server, prefix: str) -> list[dict]:
    return [c for c in server.api("GET", "/api/circuits")["circuits"] if c["name"].startswith(prefix)]


def test_a_circuit_created_and_edited_in_the_page(server, page):
    page.goto(server.url + "/circuits/")
    page.wait_for_selector("tr[data-circuit-id]")
    page.wait_for_selector(f"#ce-sae-choices option[value='{server.sae_id}']", state="attached")
    page.fill("#ce-name", "ui-made")
    page.fill("#ce-narrative", "Made in the page")
    sae = page.locator("#ce-saes tr.ce-sae").first
    sae.locator("[name=layer]").fill("1")
    sae.locator("[name=ref]").fill(server.sae_id)
    _member(page, 0, 1, 4, 12, "four")
    page.click("#ce-add-member")
    _member(page, 1, 1, 6, 3, sign="-1")
    page.click("#ce-save")
    page.wait_for_selector(".notice.ok:has-text('Created ui-made')")
    made = _circuits_named(server, "ui-made")
    assert [c["name"] for c in made] == ["ui-made"]
    stored = server.api("GET", f"/api/circuits/{made[0]['id']}")
    assert stored["narrative"] == "Made in the page"
    assert [s["ref"] for s in stored["saes"]] == [server.sae_id]
    assert stored["members"] == {
        "1": [
            {"feature_idx": 4, "strength": 12.0, "sign": 1, "label": "four"},
            {"feature_idx": 6, "strength": 3.0, "sign": -1, "label": None},
        ]
    }

    # edit: another strength, one member removed, one added; the name kept
    page.click("button[aria-label='Edit ui-made']")
    page.wait_for_selector("#editor-h:has-text('Edit circuit: ui-made')")
    # the heading already says so after the create: wait for the reloaded member rows
    page.wait_for_function("document.querySelectorAll('#ce-members tr.ce-member').length === 2")
    page.locator("#ce-members tr.ce-member").nth(0).locator("[name=strength]").fill("20")
    page.locator("#ce-members tr.ce-member").nth(1).locator("button").click()
    page.click("#ce-add-member")
    _member(page, 1, 1, 8, -5, "eight")
    page.click("#ce-save")
    page.wait_for_selector(".notice.ok:has-text('Saved ui-made')")
    first_id = made[0]["id"]
    made = _circuits_named(server, "ui-made")
    assert [c["name"] for c in made] == ["ui-made"]  # no copy left behind
    assert made[0]["id"] == first_id  # replaced in place: the same circuit
    stored = server.api("GET", f"/api/circuits/{made[0]['id']}")
    assert stored["members"] == {
        "1": [
            {"feature_idx": 4, "strength": 20.0, "sign": 1, "label": "four"},
            {"feature_idx": 8, "strength": -5.0, "sign": 1, "label": "eight"},
        ]
    }
    page.wait_for_selector("#detail-h:has-text('ui-made')")
    assert page.locator("#members tr").count() == 2

    # a member on a layer no SAE covers: the server's refusal is shown, nothing changes
    page.click("#ce-add-member")
    _member(page, 2, 3, 9, 1)
    page.click("#ce-save")
    status = page.locator("#ce-status")
    status.wait_for()
    assert "VALIDATION_ERROR" in status.inner_text()
    assert "layer 3" in status.inner_text()
    assert server.api("GET", f"/api/circuits/{made[0]['id']}")["members"] == stored["members"]
    assert [c["name"] for c in _circuits_named(server, "ui-made")] == ["ui-made"]
    screenshot(page, "circuits-editor")
    server.api("DELETE", f"/api/circuits/{made[0]['id']}")
    assert all("422" in e or "400" in e for e in page.console.errors), page.console.errors


def test_live_controls_set_listed_and_removed_in_the_steering_page(server, page):
    """The steering page sets a control in live steering (what /api then holds, and what a
    /v1 request without steering of its own runs), lists it, shows a refusal, removes it."""
    server.api("DELETE", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")
    page.goto(server.url + "/steering/")
    page.wait_for_selector("#attachment option[value^=sae_]", state="attached")
    box = page.locator("#control-editor fieldset.control")
    box.locator("[name=index]").fill("7")
    box.locator("[name=mode]").select_option("clamp")
    box.locator("[name=value]").fill("9")
    box.locator("[name=phase]").select_option("completion")
    box.locator("[name=cond-feature]").fill("3")
    box.locator("[name=cond-threshold]").fill("0.5")
    page.click("#control-set")
    page.wait_for_selector("#controls li[data-index='7'][data-mode='clamp']")
    state = server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")
    assert state["enabled"] is True and state["values"] == {}
    assert state["controls"] == [
        {
            "index": 7,
            "mode": "clamp",
            "value": 9.0,
            "phase": "completion",
            "condition": {"feature": 3, "threshold": 0.5},
        }
    ]
    assert "where #3 > 0.5" in page.inner_text("#controls li[data-index='7']")
    # a /v1 request without steering of its own runs it (the hash covers the control)
    status, out = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 4,
            "temperature": 0,
            "steering_intensity": 1,
            "messages": [{"role": "user", "content": MESSAGE}],
        },
        timeout=60,
    )  # λ = 1: the millm object
    assert status == 200 and out["millm"]["steering"]["mode"] == "live"
    assert out["millm"]["steering"]["entries"][0]["features"] == state["controls"]
    # a refusal (ablate with a value) is shown and changes nothing
    box = page.locator("#control-editor fieldset.control")
    box.locator("[name=index]").fill("8")
    box.locator("[name=mode]").select_option("scale")
    page.click("#control-set")  # scale without a value
    page.wait_for_selector(".notice.error")
    assert server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")["controls"] == state["controls"]
    page.click("button[aria-label='Remove control on feature 7']")
    page.wait_for_selector("#controls-empty:not(.hidden)")
    assert server.api("GET", f"/api/saes/steering?sae_id={server.sae_id}&layer=1")["controls"] == []
    screenshot(page, "steering-controls")
