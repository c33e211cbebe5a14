"""Two models loaded on two engines behind one front (docs/deploy.md, "Several models,
several engines"): ``tiny-llama`` on the default engine, ``tiny-gpt2`` on ``gpu1`` — a
second, real in-process engine (tests/ui/two_engines_serve.py). The pages reach every
loaded model, not the default engine's alone: the models page says which engine holds
tiny-gpt2, the playground chats with it, the SAE page attaches tiny-gpt2's SAE to it and
the captures page fills in its layers."""

from __future__ import annotations

import json
import sys

import pytest

from tests.ui.conftest import REPO, VIEWPORT, Console, direct_chat, screenshot, start_server, stop_server
from tests.ui.two_engines_serve import ROUTES

MESSAGE = "Tell me about the sea."


@pytest.fixture(scope="module")
def two_engines(tiny_assets, slow_hub, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("ui-two-engines"),
        slow_hub.url,
        {"CAPTURE_INLINE_MAX_BYTES": "0"},  # every capture stored, so listed
        serve=[sys.executable, str(REPO / "tests" / "ui" / "two_engines_serve.py")],
    )
    try:
        srv.models = {m["name"]: m for m in srv.api("GET", "/api/models")["models"]}
        for name in ("tiny-llama", "tiny-gpt2"):
            model_id = srv.models[name]["id"]
            srv.api("POST", f"/api/models/{model_id}/load")
            srv.wait_for(f"{name} to load", lambda i=model_id: srv.api("GET", f"/api/models/{i}")["status"] == "loaded")
        registry = srv.api("GET", "/api/models")
        # the premise: each engine holds its own model, neither unloaded the other
        assert registry["loaded_models"] == {
            "gpu1": srv.models["tiny-gpt2"]["id"],
            "default": srv.models["tiny-llama"]["id"],
        }
        assert registry["loaded_model_id"] == srv.models["tiny-llama"]["id"]
        yield srv
    finally:
        stop_server(srv)


def _config(tiny_assets, name: str) -> tuple[int, int]:
    """(layers, hidden size) as the checkpoint's own config.json says."""
    config = json.loads((tiny_assets.models[name].path / "config.json").read_text())
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    return layers, config.get("hidden_size", config.get("n_embd"))


def _direct(server, model: str) -> str:
    return direct_chat(server, MESSAGE, model=model)


def test_models_page_says_which_engine_holds_a_model(two_engines, page):
    page.goto(two_engines.url + "/models/")
    gpt2 = page.locator(f"#models tr[data-model-id='{two_engines.models['tiny-gpt2']['id']}']")
    llama = page.locator(f"#models tr[data-model-id='{two_engines.models['tiny-llama']['id']}']")
    gpt2.wait_for()
    assert "on engine gpu1" in gpt2.inner_text()
    assert "on engine" not in llama.inner_text()  # the default engine goes unnamed
    screenshot(page, "models-two-engines")
    page.console.assert_clean()


def test_models_page_lists_the_engines_and_what_each_holds(two_engines, page):
    # what the fixture loaded where (the registry's loaded_models), and the routes the
    # server was started with (two_engines_serve.ROUTES: "gpu1:tiny-gpt2;default:*")
    names = {m["id"]: name for name, m in two_engines.models.items()}
    loaded = {engine: names[i] for engine, i in two_engines.api("GET", "/api/models")["loaded_models"].items()}
    assert loaded == {"default": "tiny-llama", "gpu1": "tiny-gpt2"}
    allowed = dict(route.split(":", 1) for route in ROUTES.split(";"))
    page.goto(two_engines.url + "/models/")
    rows = page.locator("#engines tr[data-engine]")
    rows.first.wait_for()
    assert page.locator("#engines-panel").is_visible()
    seen = {}
    for i in range(rows.count()):
        row = rows.nth(i)
        cells = row.locator("td")
        seen[row.locator("th").inner_text()] = (
            cells.nth(0).inner_text(),
            cells.nth(2).inner_text(),
            cells.nth(3).inner_text(),
        )
    assert seen == {engine: ("alive", model, allowed[engine]) for engine, model in loaded.items()}
    assert page.locator("#engines .engine-holds .status-text").count() == 0  # the registry agrees
    screenshot(page, "models-engines-panel")
    page.console.assert_clean()


def test_playground_chats_with_the_second_engines_model(two_engines, page):
    expected, other = _direct(two_engines, "tiny-gpt2"), _direct(two_engines, "tiny-llama")
    assert expected != other  # the answer tells the two models apart
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions") else None,
    )
    page.goto(two_engines.url + "/playground/")
    option = page.locator("#model option[value='tiny-gpt2']")
    option.wait_for(state="attached")
    # the default engine's model is chosen first; the other one is offered, its engine named
    page.wait_for_function("document.querySelector('#model').value === 'tiny-llama'")
    assert option.inner_text() == "tiny-gpt2 — on engine gpu1"
    assert page.locator("#model option[value='tiny-llama']").inner_text() == "tiny-llama"
    page.select_option("#model", "tiny-gpt2")
    page.uncheck("#compare")
    page.fill("#max-tokens", "6")
    page.fill("#temperature", "0")
    page.fill("#seed", "0")
    page.fill("#message", MESSAGE)
    page.click("#send")
    selector = "#transcript-steered .turn.assistant:not(.streaming) .meta"
    page.wait_for_function(
        f"[...document.querySelectorAll('{selector}')].some(m => m.textContent.includes('tokens in'))", timeout=60_000
    )
    assert page.locator("#transcript-steered .turn.assistant .text").last.inner_text() == expected
    assert [b["model"] for b in bodies] == ["tiny-gpt2"]
    screenshot(page, "playground-two-engines")
    page.console.assert_clean()


def test_saes_page_attaches_to_the_model_on_gpu1(two_engines, tiny_assets, page):
    layers, hidden = _config(tiny_assets, "tiny-gpt2")
    sae = next(s for s in two_engines.api("GET", "/api/saes")["saes"] if s["name"] == "tiny-gpt2-L1-relu")
    page.goto(two_engines.url + "/saes/")
    page.locator(f"#attach-sae option[value='{sae['id']}']").wait_for(state="attached")
    page.select_option("#attach-sae", sae["id"])
    page.wait_for_function(
        "document.querySelector('#attach-model').textContent.startsWith('Resident model: tiny-gpt2')"
    )
    assert page.inner_text("#attach-model").startswith(
        f"Resident model: tiny-gpt2 — on engine gpu1 ({layers} layers, hidden size {hidden})"
    )
    assert page.locator("#attach-layer option").count() == layers
    page.select_option("#attach-layer", "1")
    page.locator("#compat .badge", has_text="compatible").wait_for()
    page.click("#attach-button")
    page.locator(f"tr[data-sae-id='{sae['id']}'] button", has_text="L1 ×").wait_for()
    (entry,) = [a for a in two_engines.api("GET", "/api/saes/attachments")["entries"] if a["sae_id"] == sae["id"]]
    assert (entry["layer"], entry["model_id"]) == (1, two_engines.models["tiny-gpt2"]["id"])
    screenshot(page, "saes-two-engines")
    two_engines.api("POST", f"/api/saes/{sae['id']}/detach", {"layer": 1})
    page.console.assert_clean()


def test_captures_page_captures_on_the_model_on_gpu1(two_engines, tiny_assets, page):
    layers, _ = _config(tiny_assets, "tiny-gpt2")
    page.goto(two_engines.url + "/captures/")
    option = page.locator("#c-model option[value='tiny-gpt2']")
    option.wait_for(state="attached")
    page.wait_for_function("document.querySelector('#c-model').value === 'tiny-llama'")
    assert option.inner_text() == "tiny-gpt2 — on engine gpu1"
    page.select_option("#c-model", "tiny-gpt2")
    # the chosen model's every layer (the two tiny models have as many)
    assert page.input_value("#c-layers") == ", ".join(str(i) for i in range(layers))
    page.fill("#c-prompt", MESSAGE)
    page.fill("#c-max", "2")
    page.click("#c-send")
    # stored, listed with the model it ran on
    page.locator("#captures tr", has_text="tiny-gpt2").wait_for(timeout=60_000)
    (stored,) = two_engines.api("GET", "/api/captures")["captures"]
    assert stored["model"] == "tiny-gpt2"
    page.console.assert_clean()


# --- with API keys: the engines are for admin keys --------------------------------------------

ADMIN, ALICE = "ui-engines-admin-0123456789", "ui-engines-alice-0123456789"


@pytest.fixture(scope="module")
def keyed_two_engines(tiny_assets, slow_hub, tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("ui-two-engines-keys"),
        slow_hub.url,
        {"MILLM_ADMIN_API_KEYS": ADMIN, "MILLM_API_KEYS": ALICE},
        serve=[sys.executable, str(REPO / "tests" / "ui" / "two_engines_serve.py")],
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.parametrize("key", [ADMIN, ALICE], ids=["admin", "inference"])
def test_engines_panel_is_for_admin_keys(keyed_two_engines, browser, key):
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(15_000)
    context.add_init_script(f"sessionStorage.setItem('millm.apiKey', {json.dumps(key)})")
    page = context.new_page()
    page.console = Console(page)
    try:
        with page.expect_response(lambda r: r.url.endswith("/api/engines")) as caught:
            page.goto(keyed_two_engines.url + "/models/")
        page.locator("#models tr[data-model-id]").first.wait_for()
        if key == ADMIN:
            assert caught.value.status == 200
            page.locator("#engines tr[data-engine]").first.wait_for()
            rows = page.locator("#engines tr[data-engine] th").all_inner_texts()
            assert sorted(rows) == sorted(r.split(":", 1)[0] for r in ROUTES.split(";"))
            assert page.locator("#engines-panel").is_visible()
            page.console.assert_clean()
        else:
            # an inference key's 403: the panel stays hidden, and no error is shown
            assert caught.value.status == 403
            page.locator("#engines-panel[data-state='refused']").wait_for(state="attached")
            assert not page.locator("#engines-panel").is_visible()
            assert page.locator("#engines tr").count() == 0
            assert page.locator("#notices .notice.error").count() == 0
            assert [e for e in page.console.errors if "status of 403" not in e] == []
    finally:
        context.close()
