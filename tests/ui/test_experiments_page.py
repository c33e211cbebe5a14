"""The experiments page (issue 35, part 5) against the served engine: a sweep built in the
page and started from it, its bar followed to complete (never going back), its plots' every
point the mean over prompts of the stored points at that strength (KL 0 at strength 0), the
texts side by side as stored and as ``/v1`` answers the same request alone, the download
links giving every point; a calibration's curve and the strength it found; a run cancelled
from the page (after a confirmation) ending cancelled and partial, its stored points kept
and shown; the SAE page's fidelity figures after "Measure fidelity"; attribution as a heat
strip whose cells are the server's per-position sums over the prompt's tokens, its top
features listed with their ablation check and linked to their feature pages; the
playground's "Open in experiments" carrying its feature and strength; refusals (the page's
own and the server's) said with nothing started."""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from tests.ui.conftest import VIEWPORT, Console, screenshot, start_server, stop_server
from tests.ui.runs import RECORD, ROW, completed_row, load_llama_and_attach, refuse_first_confirm
from tests.ui.test_features_pages import held_server  # noqa: F401  (a fixture: a server whose engine holds)

PROMPTS = ["The weather today is", "My favourite food is"]


def dots(page, plot: str) -> dict[str, list[tuple[float, float]]]:
    """Each series of a plot: its points (x, y) as the page holds them (data-x, data-y)."""
    raw = page.locator(f"{plot} circle.dot").evaluate_all(
        "ds => ds.map(d => [d.dataset.series, Number(d.dataset.x), Number(d.dataset.y)])"
    )
    out: dict[str, list[tuple[float, float]]] = {}
    for name, x, y in raw:
        out.setdefault(name, []).append((x, y))
    return out


def all_points(server, run_id: str) -> list[dict]:
    out = server.api("GET", f"/api/experiments/{run_id}/points?limit=1000")
    assert out["total"] == len(out["points"])
    return out["points"]


def fetch(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read()


def start_from_page(page, sae: str, *, features: str, strengths: str, prompts: list[str], max_tokens: int) -> str:
    page.select_option("#x-sae", f"{sae}@1")
    page.fill("#x-features", features)
    page.fill("#x-strengths", strengths)
    page.fill("#x-prompts", "\n".join(prompts))
    page.fill("#x-max-tokens", str(max_tokens))
    page.click("#x-start")
    started = page.locator(".notice.ok:has-text('Started sweep')")
    started.wait_for()
    return started.inner_text().split()[2]


def test_a_sweep_from_the_page_to_its_plots_texts_and_files(server, page):
    sae = server.sae_id
    feature, strengths, max_tokens = 3, [0.0, 6.0, 12.0], 6
    page.goto(f"{server.url}/experiments/")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    page.wait_for_selector("#x-sae option[value^=sae_]", state="attached")
    page.wait_for_selector("#runs tr")
    page.evaluate(RECORD)
    page.fill("#x-prompts", "\n".join(PROMPTS))
    page.fill("#x-features", str(feature))
    page.fill("#x-strengths", ", ".join(str(s) for s in strengths))
    assert page.inner_text("#x-count").startswith(
        f"2 prompt(s) × 1 variant(s) × 3 strength(s) + 2 default(s) = {2 * (1 + 3)} points"
    )
    run_id = start_from_page(
        page, sae, features=str(feature), strengths="0, 6, 12", prompts=PROMPTS, max_tokens=max_tokens
    )
    row = completed_row(page, run_id)
    run = server.api("GET", f"/api/experiments/{run_id}")
    assert run["status"] == "completed" and run["kind"] == "sweep" and run["done"] == run["total"] == 8
    assert run["spec"]["variants"] == [{"sae_id": sae, "layer": 1, "index": feature, "mode": "add"}]
    assert run["spec"]["strengths"] == strengths and run["spec"]["prompts"] == PROMPTS
    assert row.locator("progress").evaluate("b => b.value") == 100
    bars = [v for rid, _, v in page.evaluate("window.__bars") if rid == run_id]
    assert bars and bars == sorted(bars) and bars[-1] == 100  # the bar never went back

    # the run opens by itself once it ends (it was started here)
    page.wait_for_selector(f"#result-run:text-is('{run_id}')")
    page.wait_for_selector("#kl-plot circle.dot")
    points = all_points(server, run_id)
    steered = [p for p in points if not p["is_default"]]
    defaults = {p["prompt_index"]: p for p in points if p["is_default"]}
    assert len(steered) == 6 and sorted(defaults) == [0, 1]

    def mean_at(field: str, s: float) -> float:
        return float(np.mean([np.float64(p[field]) for p in steered if p["strength"] == s]))

    name = f"#{feature} add @L1"
    assert set(dots(page, "#kl-plot")) == {name}
    kl = dots(page, "#kl-plot")[name]
    assert [x for x, _ in kl] == strengths
    assert [y for _, y in kl] == pytest.approx([mean_at("kl_mean", s) for s in strengths], rel=1e-12, abs=0)
    assert kl[0][1] == pytest.approx(0.0, abs=1e-6)  # strength 0 is the unsteered model
    assert kl[-1][1] > 0
    act = dots(page, "#act-plot")
    assert set(act) == {f"{name} after", f"{name} before"}
    for suffix, field in ((" after", "target_after"), (" before", "target_before")):
        assert [y for _, y in act[name + suffix]] == pytest.approx(
            [mean_at(field, s) for s in strengths], rel=1e-12, abs=0
        )
    # adding to feature 3 raises its activation after the steering, the more the stronger
    after = [y for _, y in act[name + " after"]]
    assert after == sorted(after) and after[-1] > after[0]

    # the texts side by side: each row the stored steered text beside the prompt's default,
    # and the same as /v1 answers each request sent alone
    for p, prompt in enumerate(PROMPTS):
        page.select_option("#t-prompt", str(p))
        rows = page.locator("#texts tr")
        page.wait_for_function(
            "(want) => [...document.querySelectorAll('#texts tr')].map(r => r.querySelector('.steered-text')?.textContent)"
            ".join('\\u0000') === want",
            arg="\u0000".join(
                x["text"] for x in sorted((x for x in steered if x["prompt_index"] == p), key=lambda x: x["strength"])
            ),
        )
        assert rows.locator(".default-text").all_inner_texts() == [defaults[p]["text"]] * 3
        for s, shown in zip(strengths, rows.locator(".steered-text").all_text_contents(), strict=True):
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0}
            body["steering"] = {"features": [{"index": feature, "strength": s}], "sae_id": sae}
            status, alone = server.call("POST", "/v1/completions", body, timeout=60)
            assert status == 200, alone
            # a stored text shows a NUL as U+2400 (PostgreSQL's text refuses NUL)
            assert shown == alone["choices"][0]["text"].replace("\x00", "\u2400"), (p, s)
        status, alone = server.call(
            "POST",
            "/v1/completions",
            {**body, "steering": {"features": []}},
            timeout=60,
        )
        assert defaults[p]["text"] == alone["choices"][0]["text"].replace("\x00", "\u2400")
    screenshot(page, "experiments")

    # the download links: every point, in each format
    links = page.locator("#downloads a.download")
    assert links.evaluate_all("as => as.map(a => a.dataset.format)") == ["jsonl", "csv", "parquet"]
    hrefs = links.evaluate_all("as => as.map(a => a.href)")
    status, body = fetch(hrefs[0])
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200 and [x["text"] for x in lines] == [p["text"] for p in points]
    assert [x["kl_mean"] for x in lines] == [p["kl_mean"] for p in points]
    status, body = fetch(hrefs[1])
    table = list(csv.DictReader(io.StringIO(body.decode())))
    assert status == 200 and [r["text"] for r in table] == [p["text"] for p in points]
    status, body = fetch(hrefs[2])
    assert status == 200 and body[:4] == b"PAR1" and body[-4:] == b"PAR1"
    page.console.assert_clean()


def test_a_calibration_shows_its_curve_and_the_strength_found(server, page):
    sae = server.sae_id
    page.goto(f"{server.url}/experiments/")
    page.wait_for_selector("#x-sae option[value^=sae_]", state="attached")
    page.select_option("#x-sae", f"{sae}@1")
    page.fill("#x-prompts", "\n".join(PROMPTS))
    page.fill("#x-max-tokens", "5")
    page.fill("#x-features", "3")
    assert page.input_value("#c-feature") == "3"  # the calibration follows the sweep's first feature
    page.fill("#c-target", "0.2")
    page.fill("#c-max", "20")
    page.click("#c-start")
    started = page.locator(".notice.ok:has-text('Started calibration')")
    started.wait_for()
    run_id = started.inner_text().split()[2]
    page.wait_for_selector(ROW.format(id=run_id) + "[data-status=completed]", timeout=240_000)
    run = server.api("GET", f"/api/experiments/{run_id}")
    assert run["spec"]["variant"] == {"sae_id": sae, "layer": 1, "index": 3, "mode": "add"}
    assert run["spec"]["bounds"] == [0.0, 20.0] and run["spec"]["target_kl"] == 0.2
    result = run["result"]
    page.wait_for_selector(f"#result-run:text-is('{run_id}')")
    page.wait_for_selector("#cal-plot circle.dot")
    assert not page.locator("#cal-result").is_hidden() and page.locator("#sweep-result").is_hidden()
    curve = dots(page, "#cal-plot")["mean KL"]
    want = [(c["strength"], c["kl"]) for c in result["curve"]]
    assert curve == want and len(curve) >= 2
    assert curve[0] == (0.0, pytest.approx(0.0, abs=1e-6))  # strength 0: the unsteered model
    assert float(page.get_attribute("#cal-strength", "data-value")) == result["strength"]
    assert float(page.get_attribute("#cal-kl", "data-value")) == result["kl"]
    # the found strength is the measured one closest to the target, marked on the plot
    assert result["kl"] == min((k for _, k in want), key=lambda k: abs(k - 0.2))
    assert float(page.get_attribute("#cal-plot .ref-line[data-x]", "data-x")) == result["strength"]
    assert float(page.get_attribute("#cal-plot .ref-line[data-y]", "data-y")) == 0.2
    outcome = page.inner_text("#cal-outcome")
    assert outcome.startswith("Converged" if result["converged"] else "Not converged")
    screenshot(page, "experiments-calibration")
    page.console.assert_clean()


def test_attribution_strip_lists_features_and_links_their_pages(server, page):
    sae = server.sae_id
    prompt = "The capital of France is"
    page.goto(f"{server.url}/experiments/")
    page.wait_for_selector("#a-sae option[value^=sae_]", state="attached")
    page.fill("#a-prompt", prompt)
    page.select_option("#a-sae", f"{sae}@1")
    page.fill("#a-top", "6")
    page.click("#a-run")
    page.wait_for_selector("#attr-strip .heat-cell")
    # the same request to the API: the page shows what it answers
    want = server.api(
        "POST",
        "/api/experiments/attribution",
        {"prompt": prompt, "sae_id": sae, "layer": 1, "top_n": 6, "ablate_top": 5, "target_token": None},
    )
    cells = page.locator("#attr-strip .heat-cell")
    assert cells.count() == len(want["tokens"]) == len(want["heat"])
    assert cells.all_text_contents() == [t["text"].replace("\n", "⏎").replace("\t", "⇥") or "∅" for t in want["tokens"]]
    values = [float(v) for v in cells.evaluate_all("cs => cs.map(c => c.dataset.value)")]
    assert values == [h["sum"] for h in want["heat"]]
    # a negative sum is red, a positive one blue
    classes = cells.evaluate_all("cs => cs.map(c => c.classList.contains('neg'))")
    assert classes == [h["sum"] < 0 for h in want["heat"]]
    label = cells.nth(len(want["heat"]) - 1).get_attribute("aria-label")
    top = want["heat"][-1]["top"]
    assert label.startswith(f"token {len(want['heat'])} {json.dumps(want['tokens'][-1]['text'], ensure_ascii=False)}: ")
    assert all(f"{t['index']}" in label for t in top)
    target = want["target"]
    assert page.inner_text("#attr-target").startswith(
        f"{json.dumps(target['text'], ensure_ascii=False)} (id {target['id']}, the greedy"
    )
    # the magnitudes instead
    page.select_option("#attr-show", "total")
    page.wait_for_function(
        "(want) => JSON.stringify([...document.querySelectorAll('#attr-strip .heat-cell')]"
        ".map(c => Number(c.dataset.value))) === JSON.stringify(want)",
        arg=[h["total"] for h in want["heat"]],
    )
    # the top features, in the API's order, each with its ablation check and its page
    rows = page.locator("#attr-top tr")
    assert [int(i) for i in rows.evaluate_all("rs => rs.map(r => r.dataset.index)")] == [
        f["index"] for f in want["features"]
    ]
    ablation = rows.locator("td.ablation").all_inner_texts()
    for f, shown in zip(want["features"], ablation, strict=True):
        if f["ablation_delta"] is None:
            assert shown == "not checked"
        else:
            assert float(shown) == pytest.approx(f["ablation_delta"], rel=1e-3, abs=1e-12)
    assert sum(f["ablation_delta"] is not None for f in want["features"]) == min(5, len(want["features"]))
    screenshot(page, "experiments-attribution")
    first = want["features"][0]
    link = rows.nth(0).locator("a.feature-link")
    assert link.get_attribute("href") == f"/features/{sae}/{first['index']}/"
    link.click()
    page.wait_for_url(f"**/features/{sae}/{first['index']}/")
    page.wait_for_selector("#f-label:not(:text-is('Loading…'))")
    assert page.inner_text("h1") == f"Feature {first['index']}"
    page.console.assert_clean()


def test_the_sae_page_measures_and_shows_fidelity(server, page):
    sae = server.sae_id
    page.goto(f"{server.url}/saes/")
    page.wait_for_selector("#fid-sae option[value^=sae_]", state="attached")
    page.select_option("#fid-sae", sae)
    page.wait_for_function("document.querySelector('#fid-note').textContent !== 'Loading…'")
    before = server.api("GET", f"/api/saes/{sae}/fidelity")
    page.fill("#fid-budget", "512")
    page.fill("#fid-context", "32")
    page.click("#fid-start")
    started = page.locator(".notice.ok:has-text('Started fidelity run')")
    started.wait_for()
    run_id = started.inner_text().split()[3]
    page.wait_for_selector(f"#fid-progress [data-run-id='{run_id}']")
    page.wait_for_selector(f"#fid-figures[data-run-id='{run_id}']:not(.hidden)", timeout=240_000)
    shown = server.api("GET", f"/api/saes/{sae}/fidelity")
    assert shown["run_id"] == run_id != before["run_id"]
    f = shown["fidelity"]
    assert f["tokens"] > 0 and f["rows"] > 0
    for sel, key in (
        ("#fid-l0", "l0"),
        ("#fid-mse", "mse"),
        ("#fid-ev", "explained_variance"),
        ("#fid-lr", "loss_recovered"),
        ("#fid-dead", "dead_count"),
        ("#fid-dense", "dense_count"),
    ):
        raw = page.get_attribute(sel, "data-value")
        assert (raw == "" and f[key] is None) or float(raw) == f[key], (sel, raw, f[key])
    assert (
        page.locator(f"#fid-progress [data-run-id='{run_id}'][data-status=completed] progress").evaluate("b => b.value")
        == 100
    )
    assert "Next-token loss: clean" in page.inner_text("#fid-detail")
    screenshot(page, "saes-fidelity")
    # the run is an experiment like the others: listed on the experiments page
    page.goto(f"{server.url}/experiments/")
    row = page.locator(ROW.format(id=run_id))
    row.wait_for()
    assert row.get_attribute("data-kind") == "fidelity" and row.get_attribute("data-status") == "completed"
    page.console.assert_clean()


def test_the_playground_opens_its_feature_in_experiments(server, page):
    sae = server.sae_id
    page.goto(f"{server.url}/playground/")
    page.wait_for_selector("#heat-sae option[value^=sae_]", state="attached")
    page.check("input[name=steer-mode][value=inline]")
    page.fill("#inline-features", "5: 7\n2: -3")
    href = page.get_attribute("#exp-link", "href")
    assert href == "/experiments/?" + urllib.parse.urlencode(
        {"sae_id": sae, "layer": "1", "feature": "5", "strength": "7"}
    )
    page.click("#exp-link")
    page.wait_for_url("**/experiments/**")
    page.wait_for_function("document.querySelector('#x-features').value === '5'")
    assert page.input_value("#x-sae") == f"{sae}@1"
    assert page.input_value("#x-strengths") == "0, 3.5, 7, 14"
    assert page.input_value("#c-feature") == "5"
    assert page.locator("nav a[aria-current=page]").inner_text() == "Experiments"
    page.console.assert_clean()


def test_presets_and_refusals_are_said_and_start_nothing(server, page):
    sae = server.sae_id
    total = server.api("GET", "/api/experiments")["total"]
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    markup = "<img src=x onerror=alert(1)>"
    page.goto(f"{server.url}/experiments/?" + urllib.parse.urlencode({"sae_id": markup, "feature": "abc"}))
    error = page.locator(".notice.error")
    error.wait_for()
    assert "is not a feature index and a strength: ignored" in error.inner_text()
    page.goto(f"{server.url}/experiments/?" + urllib.parse.urlencode({"sae_id": markup, "feature": "4"}))
    error = page.locator(".notice.error")
    error.wait_for()
    assert f"SAE {markup} is not attached" in error.inner_text()  # said as text
    assert page.locator("#notices img").count() == 0 and dialogs == []
    page.locator(".notice.error button").click()

    # the page's own checks, naming the field: nothing sent
    page.wait_for_selector("#x-sae option[value^=sae_]", state="attached")
    page.select_option("#x-sae", f"{sae}@1")
    page.fill("#x-features", "1")
    page.fill("#x-strengths", "1, x")
    page.click("#x-start")
    page.wait_for_selector(".notice.error:has-text('is not a number')")
    assert "Strengths" in page.inner_text(".notice.error") and "“x”" in page.inner_text(".notice.error")
    assert page.get_attribute("#x-strengths", "aria-invalid") == "true"
    page.locator(".notice.error button").click()
    d_sae = next(a for a in server.api("GET", "/api/saes/attachments")["entries"] if a["sae_id"] == sae)["d_sae"]
    page.fill("#x-strengths", "1, 2")
    page.fill("#x-features", str(d_sae))
    page.click("#x-start")
    page.wait_for_selector(f".notice.error:has-text('{d_sae} is outside 0…{d_sae - 1}')")
    page.locator(".notice.error button").click()
    # the server's refusal: a grid above EXPERIMENT_MAX_POINTS, said in the hint first
    page.fill("#x-features", "1, 2")
    page.fill("#x-prompts", "\n".join(PROMPTS * 2))
    page.fill("#x-strengths", ", ".join(str(s) for s in range(1, 33)))
    hint = page.locator("#x-count")
    assert "= 260 points (at most 256" in hint.inner_text() and "bad" in hint.get_attribute("class")
    page.click("#x-start")
    refusal = page.locator(".notice.error")
    refusal.wait_for()
    assert "EXPERIMENT_MAX_POINTS" in refusal.inner_text() and "260" in refusal.inner_text()
    assert server.api("GET", "/api/experiments")["total"] == total
    assert [e for e in page.console.errors if "status of 422" not in e] == []


def test_the_page_renders_with_labelled_controls(server, page):
    from tests.ui.test_narrow_screens import NARROW, OUTSIDE
    from tests.ui.test_pages import UNLABELLED

    page.goto(f"{server.url}/experiments/")
    page.wait_for_selector("#x-sae option[value^=sae_]", state="attached")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    assert page.inner_text("h1") == "Experiments"
    assert page.locator("nav a[aria-current=page]").inner_text() == "Experiments"
    assert page.evaluate(UNLABELLED) == []
    # on a phone-sized screen: one column, nothing wider than the screen outside a panel that scrolls
    page.set_viewport_size(NARROW)
    page.wait_for_function(f"document.documentElement.clientWidth === {NARROW['width']}")
    assert page.evaluate(OUTSIDE) == []
    assert page.evaluate("document.documentElement.scrollWidth") == NARROW["width"]
    page.console.assert_clean()


def test_cancel_asks_first_and_keeps_the_points_done(held_server, page):
    """A sweep whose generations the engine holds once a few points are stored: Cancel asks
    first (a refusal to confirm changes nothing), the row ends cancelled and partial, and
    the run's stored points (as the API lists them) are what the page opens."""
    server, hold, reached = held_server
    sae = server.sae_id
    hold.touch()
    body = {
        "prompts": [f"{w} weather is" for w in ("Monday", "Tuesday", "Friday", "Sunday")],
        "variants": [{"sae_id": sae, "layer": 1, "index": i, "mode": "add"} for i in (1, 3)],
        "strengths": [float(s) for s in range(8)],
        "max_tokens": 4,
    }
    run_id = server.api("POST", "/api/experiments/sweep", body)["run"]["id"]
    server.wait_for("the engine to hold the sweep's first generation", reached.exists)
    # let some points through, then hold the rest
    hold.unlink()
    server.wait_for(
        "a point to be stored", lambda: server.api("GET", f"/api/experiments/{run_id}")["done"] >= 1, interval=0.02
    )
    hold.touch()
    run = server.api("GET", f"/api/experiments/{run_id}")
    assert run["status"] == "running" and 1 <= run["done"] < run["total"] == 4 * (1 + 2 * 8)

    page.goto(f"{server.url}/experiments/")
    row = page.locator(ROW.format(id=run_id))
    row.wait_for()
    asked = refuse_first_confirm(page)
    button = row.get_by_role("button", name=f"Cancel run {run_id}")
    button.click()  # dismissed: nothing sent
    assert len(asked) == 1 and run_id in asked[0]
    assert server.api("GET", f"/api/experiments/{run_id}")["status"] == "running"
    button.click()
    page.wait_for_selector(ROW.format(id=run_id) + "[data-status=cancelled]", timeout=60_000)
    hold.unlink()
    run = server.api("GET", f"/api/experiments/{run_id}")
    assert run["status"] == "cancelled" and run["partial"] and run["done"] < run["total"]
    assert row.get_attribute("data-partial") == "1" and row.locator(".badge:text-is('partial')").count() == 1
    assert row.get_by_role("button", name=f"Cancel run {run_id}").count() == 0
    points = all_points(server, run_id)
    assert 1 <= len(points) == run["done"]
    # opened: the points stored, said to be partial
    row.get_by_role("button", name=f"Open run {run_id}").click()
    page.wait_for_selector(f"#result-run:text-is('{run_id}')")
    assert "Partial" in page.inner_text("#result-note")
    shown = page.locator("#kl-plot circle.dot").evaluate_all("ds => ds.map(d => Number(d.dataset.x))")
    assert sorted(set(shown)) == sorted({p["strength"] for p in points if not p["is_default"]})
    page.console.assert_clean()


# --- with API keys ---------------------------------------------------------------------------

ADMIN, ALICE, BOB = "ui-exp-admin-0123456789", "ui-exp-alice-0123456789", "ui-exp-bob-0123456789"


def call_as(server, key: str | None, method: str, path: str, body: dict | None = None) -> tuple[int, dict | bytes]:
    request = urllib.request.Request(
        server.url + path, data=None if body is None else json.dumps(body).encode(), method=method
    )
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(
                raw
            ) if response.headers.get_content_type() == "application/json" else raw
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def keyed_server(tiny_assets, slow_hub, tmp_path_factory):
    """A server with an admin key and two inference keys, tiny-llama loaded and its layer-1
    SAE attached (with the admin key)."""
    srv = start_server(
        tmp_path_factory.mktemp("ui-exp-keys"),
        slow_hub.url,
        {"MILLM_ADMIN_API_KEYS": ADMIN, "MILLM_API_KEYS": f"{ALICE},{BOB}"},
    )
    try:
        load_llama_and_attach(srv)
        yield srv
    finally:
        stop_server(srv)


def test_with_keys_the_owner_downloads_and_another_key_sees_nothing(keyed_server, browser):
    server = keyed_server
    body = {
        "prompts": ["Keys and locks"],
        "variants": [{"sae_id": server.sae_id, "layer": 1, "index": 2, "mode": "add"}],
        "strengths": [0.0, 9.0],
        "max_tokens": 3,
    }
    status, out = call_as(server, ALICE, "POST", "/api/experiments/sweep", body)
    assert status == 202, out
    run_id = out["data"]["run"]["id"]
    server.wait_for(
        "the sweep to complete",
        lambda: call_as(server, ALICE, "GET", f"/api/experiments/{run_id}")[1]["data"]["status"] == "completed",
        timeout=120,
    )
    points = call_as(server, ALICE, "GET", f"/api/experiments/{run_id}/points")[1]["data"]["points"]
    href = f"/api/experiments/{run_id}/download?format=jsonl"
    assert call_as(server, None, "GET", href)[0] == 401  # the link alone carries no key

    def tab(key: str):
        context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        context.set_default_timeout(15_000)
        context.add_init_script(f"sessionStorage.setItem('millm.apiKey', {json.dumps(key)})")
        page = context.new_page()
        page.console = Console(page)
        return context, page

    context, page = tab(ALICE)
    try:
        page.goto(f"{server.url}/experiments/?run={run_id}")
        page.wait_for_selector(f"#result-run:text-is('{run_id}')")
        assert page.locator(ROW.format(id=run_id)).count() == 1
        with page.expect_download() as caught:
            page.click("#downloads a[data-format=jsonl]")
        download = caught.value
        assert download.suggested_filename == f"{run_id}.jsonl"
        lines = [json.loads(line) for line in open(download.path(), encoding="utf-8")]
        assert [x["text"] for x in lines] == [p["text"] for p in points] and len(lines) == 3
        page.console.assert_clean()
    finally:
        context.close()

    # another inference key: the run is not in its list, and opening it is the server's 404
    context, page = tab(BOB)
    try:
        page.goto(f"{server.url}/experiments/?run={run_id}")
        page.wait_for_selector("#runs td.empty")
        error = page.locator(".notice.error")
        error.wait_for()
        assert "404" in error.inner_text() or "NOT_FOUND" in error.inner_text()
        assert page.inner_text("#result-run") == ""
        assert [e for e in page.console.errors if "status of 404" not in e] == []
    finally:
        context.close()
