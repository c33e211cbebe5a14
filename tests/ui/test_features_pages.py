"""The features pages (issue 34): the feature page shows what the API stores for a feature —
each heat-strip cell's value is the stored activation of that token, the max token marked,
one histogram bar per stored bin with its count, the logit lists in order — with its label
and explanations; "Steer with it" opens the playground with the feature preset (and the
steered answer is what /v1 gives for that steering); "Add to a profile" adds the feature
through the profile routes, and the server's refusal is shown with nothing changed;
"open its dashboard" on a playground heat-strip cell leads to the feature's page.

Two worlds: dashboard rows written straight into the served database (a run and a feature
with values the test chose, so every figure on the page is checked against numbers the test
wrote), and a real dashboard job started from the dashboards page on the offline sample
corpus, its bar followed to complete and its features searched and opened."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import sys

import numpy as np
import pytest

from tests.ui.conftest import REPO, _env, screenshot, start_server, stop_server
from tests.ui.runs import RECORD, ROW, completed_row, load_llama_and_attach, refuse_first_confirm

# --- rows written straight into the served database ---------------------------------------

SEED = """
import json, os
from django.db import transaction
from features.models import DashboardRun, FeatureDashboard
from registry.models import FeatureExplanation
spec = json.loads(os.environ["UI_SEED"])
with transaction.atomic():
    run = DashboardRun.objects.create(
        sae_id=spec["sae_id"], layer=spec["layer"], token_budget=spec["tokens"],
        status="completed", complete=True, contexts_total=4, contexts_done=4,
        tokens_done=spec["tokens"], summary=spec["summary"])
    for f in spec["features"]:
        FeatureDashboard.objects.create(run=run, sae_id=spec["sae_id"], **f)
    for x in spec["explanations"]:
        FeatureExplanation.objects.create(sae_id=spec["sae_id"], **x)
print(run.id)
"""


def seed(server, slow_hub, spec: dict) -> str:
    """Write a complete run with its feature rows into the served database (through the ORM,
    in the server's own environment); its run id."""
    env = _env(server.log.parent, slow_hub.url, {"CAPTURE_INLINE_MAX_BYTES": "0", "UI_SEED": json.dumps(spec)})
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "shell", "-c", SEED],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def context(rng, tokens: list[str], peak: int) -> dict:
    acts = [0.0 if rng.random() < 0.4 else float(np.float32(rng.uniform(0.01, 2.0))) for _ in tokens]
    acts[peak] = float(np.float32(3.0 + rng.random()))
    return {
        "context": int(rng.integers(0, 100)),
        "tokens": tokens,
        "token_ids": [int(t) for t in rng.integers(0, 500, len(tokens))],
        "activations": acts,
        "max_position": peak,
        "max_activation": acts[peak],
    }


def strip_values(locator) -> list[list[float]]:
    """Each strip's cells' values as the page holds them (data-value)."""
    return locator.evaluate_all(
        "strips => strips.map(s => [...s.querySelectorAll('.heat-cell')].map(c => Number(c.dataset.value)))"
    )


def marked(locator) -> list[list[int]]:
    return locator.evaluate_all(
        "strips => strips.map(s => [...s.querySelectorAll('.heat-cell')]"
        ".flatMap((c, i) => c.dataset.max === '1' && c.classList.contains('max') ? [i] : []))"
    )


@pytest.fixture
def copy_sae(server, tiny_assets, tmp_path):
    """A second copy of the tiny SAE, registered and attached at layer 2 (its own rows and
    profile), detached and its profile removed afterwards."""
    folder = tmp_path / "features-copy"
    shutil.copytree(tiny_assets.saes["tiny-llama-L1-relu"].path, folder)
    sae = server.api("POST", "/api/saes", {"source": "local", "local_path": str(folder), "name": "features-copy"})[
        "sae_id"
    ]
    server.api("POST", f"/api/saes/{sae}/attach", {"layer": 2})
    profile = server.api(
        "POST", "/api/profiles", {"name": "features-copy-p", "sae_id": sae, "layer": 2, "steering": {"1": 3}}
    )
    try:
        yield sae
    finally:
        server.api("DELETE", f"/api/profiles/{profile['id']}")
        server.api("POST", f"/api/saes/{sae}/detach", {"layer": 2})


def test_the_feature_page_shows_the_stored_dashboard(server, slow_hub, copy_sae, page):
    rng = np.random.default_rng(34)
    index = 5
    words = ["The", " rain", " in", " Spain", " falls", "\n", " mainly", " on", " the", " plain", "."]
    top = [context(rng, words[: 7 + k], peak=2 + k) for k in range(3)]
    bands = [
        {"band": [0.25, 1.5], "contexts": [context(rng, words[:6], peak=1)]},
        {"band": [0.0, 0.25], "contexts": [context(rng, words[2:9], peak=3), context(rng, words[:5], peak=0)]},
    ]
    counts = [int(c) for c in rng.integers(0, 40, 12)]
    counts[4] = 0
    edges = [float(e) for e in np.linspace(0.0, 3.9, 13)]
    logit_top = [
        {"token_id": 10 + i, "token": t, "value": 2.5 - 0.3 * i} for i, t in enumerate([" wet", " storm", "\t"])
    ]
    logit_bottom = [{"token_id": 20 + i, "token": t, "value": -1.75 + 0.2 * i} for i, t in enumerate([" dry", " sun"])]
    spec = {
        "sae_id": copy_sae,
        "layer": 2,
        "tokens": 4096,
        "summary": {"tokens": 4096, "contexts": 64, "dead": 3, "dead_share": 3 / 256, "dense": [index], "l0": {}},
        "features": [
            {
                "index": index,
                "count": sum(counts),
                "density": sum(counts) / 4096,
                "mean": 1.125,
                "max": max(c["max_activation"] for c in top),
                "histogram": {"edges": edges, "counts": counts},
                "top_contexts": top,
                "quantile_samples": bands,
                "logit_top": logit_top,
                "logit_bottom": logit_bottom,
                "search_tokens": "rain spain",
            }
        ],
        "explanations": [
            {
                "index": index,
                "description": "rain and weather words",
                "source": "explainer",
                "explainer_model": "stand-in-explainer",
                "score": 0.8125,
                "provenance": {"contexts": 3},
                "created_by": "ui-test",
            },
            {"index": index, "description": "Spanish places", "source": "user", "score": None},
        ],
    }
    run_id = seed(server, slow_hub, spec)
    stored = server.api("GET", f"/api/saes/{copy_sae}/features/{index}")
    assert stored["run_id"] == run_id and stored["dashboard"]["top_contexts"] == top  # the API gives what was written

    page.goto(f"{server.url}/features/{copy_sae}/{index}/")
    page.wait_for_selector("#top-contexts .heat-strip")
    assert page.inner_text("h1") == f"Feature {index}"
    assert page.locator("nav a[aria-current=page]").inner_text() == "Features"
    assert page.inner_text("#f-label") == "rain and weather words"  # the best (highest score) explanation
    rows = page.locator("#explanations tr")
    assert rows.count() == 2
    assert rows.nth(0).locator(".description").inner_text() == "rain and weather words"
    assert rows.nth(0).locator(".score").inner_text() == "0.813"
    assert "stand-in-explainer" in rows.nth(0).locator(".provenance").inner_text()
    assert rows.nth(1).locator(".score").inner_text() == "—"

    # every cell the stored activation of its token, each context's max token marked
    strips = page.locator("#top-contexts .heat-strip")
    assert strip_values(strips) == [c["activations"] for c in top]
    assert marked(strips) == [[c["max_position"]] for c in top]
    cell = strips.nth(0).locator(".heat-cell").nth(top[0]["max_position"])
    assert cell.get_attribute("aria-label") == (
        f"token {top[0]['max_position'] + 1} {json.dumps(words[top[0]['max_position']])}: "
        f"feature {index} = {top[0]['max_activation']:.3f} (max)"
    )
    assert strips.nth(0).locator(".heat-cell").all_inner_texts() == [w.replace("\n", "⏎") for w in words[:7]]
    band_strips = page.locator("#quantiles .heat-strip")
    assert strip_values(band_strips) == [c["activations"] for b in bands for c in b["contexts"]]
    assert marked(band_strips) == [[c["max_position"]] for b in bands for c in b["contexts"]]

    # one bar per stored bin, each with its count and edges; the density bar's value
    bars = page.locator("#hist-plot rect.hist-bar")
    assert bars.count() == len(counts)
    assert [int(b) for b in bars.evaluate_all("bs => bs.map(b => b.dataset.count)")] == counts
    assert [float(x) for x in bars.evaluate_all("bs => bs.map(b => b.dataset.lo)")] == edges[:-1]
    heights = bars.evaluate_all("bs => bs.map(b => Number(b.getAttribute('height')))")
    assert heights[4] == 0 and heights[int(np.argmax(counts))] == max(heights) > 0
    density = float(page.locator("#density-plot rect.density-bar").get_attribute("data-density"))
    assert density == sum(counts) / 4096

    # the logit lists, in order, with their values
    for sel, want in (("#logit-top", logit_top), ("#logit-bottom", logit_bottom)):
        items = page.locator(f"{sel} li")
        assert items.locator(".tok").evaluate_all("ts => ts.map(t => JSON.parse(t.title))") == [
            w["token"] for w in want
        ]
        assert [float(v) for v in items.evaluate_all("ls => ls.map(l => l.dataset.value)")] == [
            w["value"] for w in want
        ]
    screenshot(page, "feature")

    # Add to a profile: the server's refusal shown, nothing changed; then added
    before = server.api("GET", "/api/profiles/features-copy-p")["steering"]
    page.select_option("#u-profile", label="features-copy-p")
    page.fill("#u-strength", "500")
    page.click("#u-add")
    refusal = page.locator("#u-status.bad")
    refusal.wait_for()
    assert "Not added" in refusal.inner_text()
    assert page.locator(".notice.error").count() == 1
    assert server.api("GET", "/api/profiles/features-copy-p")["steering"] == before
    # the browser logs the refused call (422) as a failed resource; nothing else
    assert [e for e in page.console.errors if "status of 422" not in e] == []
    page.console.errors.clear()
    page.fill("#u-strength", "12.5")
    page.click("#u-add")
    page.wait_for_selector("#u-status.ok")
    assert server.api("GET", "/api/profiles/features-copy-p")["steering"] == {**before, str(index): 12.5}

    # Steer with it: the playground, preset with this feature
    page.click("#steer-link")
    page.wait_for_url("**/playground/**")
    page.wait_for_selector("#preset-note:has-text('Preset')")
    assert page.locator("input[name=steer-mode][value=inline]").is_checked()
    assert page.input_value("#inline-features") == f"{index}: 12.5"
    assert page.input_value("#heat-sae") == f"{copy_sae}@2"
    assert page.input_value("#heat-mode") == "feature" and page.input_value("#heat-feature") == str(index)
    page.fill("#max-tokens", "6")
    page.fill("#message", "Weather report")
    page.click("#send")
    page.wait_for_selector("#transcript-steered .heat-strip", timeout=60_000)
    page.wait_for_selector("#transcript-plain .heat-strip", timeout=60_000)
    status, direct = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 6,
            "temperature": 0,
            "seed": 0,
            "messages": [{"role": "user", "content": "Weather report"}],
            "steering": {"features": [{"index": index, "strength": 12.5}], "sae_id": copy_sae},
        },
        timeout=60,
    )
    assert status == 200
    assert (
        page.locator("#transcript-steered .turn.assistant .text").inner_text()
        == (direct["choices"][0]["message"]["content"])
    )

    # "open its dashboard" from the focused cell's line
    page.locator("#transcript-steered .heat-cell").first.focus()
    link = page.locator(f"#transcript-steered .heat-features a[data-feature='{index}']")
    assert link.get_attribute("href") == f"/features/{copy_sae}/{index}/"
    assert link.inner_text() == f"feature {index}: rain and weather words"  # with its label
    link.click()
    page.wait_for_url(f"**/features/{copy_sae}/{index}/")
    page.wait_for_selector("#top-contexts .heat-strip")
    page.console.assert_clean()


def test_a_feature_without_a_dashboard_says_so(server, copy_sae, page):
    assert server.api("GET", f"/api/saes/{copy_sae}/features/7")["dashboard"] is None  # a fresh SAE: no run
    page.goto(f"{server.url}/features/{copy_sae}/7/")
    note = page.locator("#no-dashboard")
    note.wait_for()
    assert note.locator("a").get_attribute("href") == "/dashboards/"
    assert page.locator("#top-contexts .heat-strip").count() == 0
    page.console.assert_clean()
    # a feature outside the SAE: the server's refusal, said
    page.goto(f"{server.url}/features/{copy_sae}/99999/")
    page.wait_for_selector(".notice.error")
    assert "INVALID_FEATURE_INDEX" in page.inner_text("#f-label")


# --- a real dashboard job ------------------------------------------------------------------


def _locale_int(page, value: int) -> str:
    return page.evaluate("(v) => v.toLocaleString(undefined, {maximumFractionDigits: 0})", value)


def test_a_real_dashboard_run_from_the_page_to_a_feature_and_the_playground(server, page):
    sae = server.sae_id
    page.goto(f"{server.url}/dashboards/?sae_id={sae}")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    page.wait_for_selector("#runs tr")
    assert page.input_value("#d-sae") == sae
    page.evaluate(RECORD)
    page.fill("#d-budget", "1024")
    page.fill("#d-context", "32")
    page.click("#d-start")
    started = page.locator(".notice.ok:has-text('Started run')")
    started.wait_for()
    run_id = started.inner_text().split()[2]
    row = completed_row(page, run_id)
    run = server.api("GET", f"/api/dashboards/{run_id}")
    assert run["status"] == "completed" and run["complete"] and run["token_budget"] == 1024
    assert row.locator("progress").evaluate("b => b.value") == 100
    bars = [v for rid, _, v in page.evaluate("window.__bars") if rid == run_id]
    assert bars and bars == sorted(bars) and bars[-1] == 100  # the bar never went back
    assert int(row.get_attribute("data-tokens-done")) == run["tokens_done"] > 0
    # the corpus-wide figures of the complete run
    summary = run["summary"]
    page.wait_for_selector(f"#summary-run:text-is('{run_id}')")
    assert page.inner_text("#s-tokens") == _locale_int(page, summary["tokens"])
    assert page.inner_text("#s-dense") == _locale_int(page, len(summary["dense"]))
    assert page.inner_text("#s-dead").startswith(_locale_int(page, summary["dead"]) + " ")
    l0 = page.locator("#l0-plot rect.hist-bar")
    assert [int(c) for c in l0.evaluate_all("bs => bs.map(b => b.dataset.count)")] == summary["l0"]["histogram"][
        "counts"
    ]
    screenshot(page, "dashboards")

    # search by a token of a feature's top context, as the API finds it
    listed = server.api("GET", f"/api/saes/{sae}/features?limit=200")["features"]
    chosen = next(f for f in listed if f["max"])
    stored = server.api("GET", f"/api/saes/{sae}/features/{chosen['index']}")
    assert stored["run_id"] == run_id
    dash = stored["dashboard"]
    best = dash["top_contexts"][0]
    token = next(
        (t for t in [best["tokens"][best["max_position"]], *best["tokens"]] if t.strip().isalpha()),
        best["tokens"][best["max_position"]],
    ).strip()
    hits = server.api("GET", f"/api/saes/{sae}/features?token={urllib.parse.quote(token)}&limit=50")
    assert any(h["index"] == chosen["index"] for h in hits["features"])
    page.goto(f"{server.url}/features/?sae_id={sae}")
    page.wait_for_selector("#f-results tr[data-index]")
    page.fill("#f-token", token)
    page.click("#f-search")
    # the rows the API ranks for that token, in its order
    page.wait_for_function(
        "(want) => JSON.stringify([...document.querySelectorAll('#f-results tr[data-index]')]"
        ".map(r => Number(r.dataset.index))) === JSON.stringify(want)",
        arg=[h["index"] for h in hits["features"]],
    )
    assert page.inner_text("#f-total") == f"{len(hits['features'])} of {hits['total']}"
    assert f"token={urllib.parse.quote(token)}" in page.url
    result = page.locator(f"#f-results tr[data-index='{chosen['index']}']")
    assert float(result.get_attribute("data-max")) == chosen["max"]
    screenshot(page, "features")
    result.locator("a").click()

    # the feature page: the stored activations, histogram bins and logit effects
    page.wait_for_url(f"**/features/{sae}/{chosen['index']}/")
    page.wait_for_selector("#top-contexts .heat-strip")
    strips = page.locator("#top-contexts .heat-strip")
    assert strip_values(strips) == [c["activations"] for c in dash["top_contexts"]]
    assert marked(strips) == [[c["max_position"]] for c in dash["top_contexts"]]
    band_strips = page.locator("#quantiles .heat-strip")
    assert strip_values(band_strips) == [c["activations"] for b in dash["quantile_samples"] for c in b["contexts"]]
    bars = page.locator("#hist-plot rect.hist-bar")
    assert bars.count() == len(dash["histogram"]["counts"])
    assert [int(b) for b in bars.evaluate_all("bs => bs.map(b => b.dataset.count)")] == dash["histogram"]["counts"]
    for sel, want in (("#logit-top", dash["logit_top"]), ("#logit-bottom", dash["logit_bottom"])):
        assert want, "the run stores logit effects"
        items = page.locator(f"{sel} li")
        assert items.locator(".tok").evaluate_all("ts => ts.map(t => JSON.parse(t.title))") == [
            w["token"] for w in want
        ]
        assert [float(v) for v in items.evaluate_all("ls => ls.map(l => l.dataset.value)")] == [
            w["value"] for w in want
        ]
        assert [int(v) for v in items.evaluate_all("ls => ls.map(l => l.dataset.tokenId)")] == [
            w["token_id"] for w in want
        ]

    # Steer with it: the playground preset; "open its dashboard" from a strip's cell
    page.fill("#u-strength", "8")
    page.click("#steer-link")
    page.wait_for_url("**/playground/**")
    page.wait_for_selector("#preset-note:has-text('Preset')")
    assert page.locator("input[name=steer-mode][value=inline]").is_checked()
    assert page.input_value("#inline-features") == f"{chosen['index']}: 8"
    assert page.input_value("#heat-sae") == f"{sae}@1"
    assert page.input_value("#heat-feature") == str(chosen["index"])
    page.fill("#max-tokens", "4")
    page.fill("#message", "Open a dashboard")
    page.click("#send")
    page.wait_for_selector("#transcript-steered .heat-strip", timeout=60_000)
    cell = page.locator("#transcript-steered .heat-cell").nth(1)
    cell.hover()
    features = cell.get_attribute("data-features").split(",")
    links = page.locator("#transcript-steered .heat-features a.feature-link")
    assert links.evaluate_all("as => as.map(a => a.dataset.feature)") == features
    other = features[-1]  # the position's own top feature (the strip is coloured by the chosen one)
    page.locator(f"#transcript-steered .heat-features a[data-feature='{other}']").click()
    page.wait_for_url(f"**/features/{sae}/{other}/")
    page.wait_for_selector("#f-label:not(:text-is('Loading…'))")
    opened = server.api("GET", f"/api/saes/{sae}/features/{other}")
    assert page.locator("#top-contexts .heat-strip").count() == len((opened["dashboard"] or {}).get("top_contexts", []))
    page.console.assert_clean()


# ``manage.py serve`` with its engine holding each generation at its first token while the
# test's hold file exists (tests/distributed/held_engine.py): a dashboard's contexts are
# one-token generations, so a run's contexts stay at the engine until the test lets them go
# or the run is cancelled (a run over a corpus long enough for the slowest machine ended
# before its cancel was clicked on a fast one)
HELD_SERVE = [sys.executable, str(REPO / "tests" / "distributed" / "held_engine.py"), "serve"]


@pytest.fixture
def held_server(tiny_assets, slow_hub, tmp_path):
    """A server of the test's own, tiny-llama loaded and its layer-1 SAE attached, whose
    engine holds generations while ``hold`` exists; ``reached`` appears once it holds one.
    Yields (server, hold, reached)."""
    root = tmp_path / "held-server"
    root.mkdir()
    hold, reached = tmp_path / "hold", tmp_path / "reached"
    env = {"MILLM_TEST_HOLD_FILE": str(hold), "MILLM_TEST_HOLD_AT": "1", "MILLM_TEST_HOLD_REACHED": str(reached)}
    srv = start_server(root, slow_hub.url, env, serve=HELD_SERVE)
    try:
        load_llama_and_attach(srv)
        yield srv, hold, reached
    finally:
        hold.unlink(missing_ok=True)
        stop_server(srv)


def test_cancel_asks_first_and_the_rows_end_cancelled(held_server, page):
    """Two runs (the pool runs one at a time, so the second waits queued), the first's
    contexts held at the engine: each is cancelled from the page after a confirmation, a
    refusal to confirm changes nothing, and neither stores a dashboard."""
    server, hold, reached = held_server
    sae = server.sae_id
    before = server.api("GET", f"/api/saes/{sae}/features?limit=1")
    body = {"corpus": "sample", "token_budget": 4096, "context_tokens": 32}
    hold.touch()
    first = server.api("POST", f"/api/saes/{sae}/dashboards", body)["run"]["id"]
    second = server.api("POST", f"/api/saes/{sae}/dashboards", body)["run"]["id"]
    server.wait_for("the engine to hold the first run's context", reached.exists)
    assert server.api("GET", f"/api/dashboards/{first}")["status"] == "running"
    assert server.api("GET", f"/api/dashboards/{second}")["status"] == "queued"
    page.goto(f"{server.url}/dashboards/?sae_id={sae}")
    asked = refuse_first_confirm(page)
    for n, run_id in enumerate((second, first)):
        row = page.locator(ROW.format(id=run_id))
        button = row.get_by_role("button", name=f"Cancel run {run_id}")
        if n == 0:
            button.click()  # dismissed: nothing sent
            assert len(asked) == 1 and run_id in asked[0]
            assert server.api("GET", f"/api/dashboards/{run_id}")["status"] == "queued"
        button.click()
        page.wait_for_selector(ROW.format(id=run_id) + "[data-status=cancelled]", timeout=60_000)
        run = server.api("GET", f"/api/dashboards/{run_id}")
        assert run["status"] == "cancelled" and not run["complete"]
        assert run["contexts_done"] == 0  # none finished: the second never ran, the first was held
        assert row.get_by_role("button", name=f"Cancel run {run_id}").count() == 0
    assert len(asked) == 3
    hold.unlink()
    # nothing of either run is a dashboard
    assert server.api("GET", f"/api/saes/{sae}/features?limit=1")["total"] == before["total"]
    page.console.assert_clean()


@pytest.mark.parametrize(
    ("path", "title", "nav", "ready"),
    [
        ("/features/", "Features", "Features", "#f-sae option[value^=sae_]"),
        ("/dashboards/", "Dashboards", "Dashboards", "#d-sae option[value^=sae_]"),
        ("/features/{sae}/3/", "Feature 3", "Features", "#u-profile option"),
    ],
    ids=["features", "dashboards", "feature"],
)
def test_the_pages_render_with_labelled_controls(server, page, path, title, nav, ready):
    from tests.ui.test_pages import UNLABELLED

    page.goto(server.url + path.format(sae=server.sae_id))
    page.wait_for_selector(ready, state="attached")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    assert page.inner_text("h1") == title
    assert page.locator("nav a[aria-current=page]").inner_text() == nav
    assert page.evaluate(UNLABELLED) == []
    page.console.assert_clean()


def test_a_refused_start_is_said_and_starts_nothing(server, page):
    sae = server.sae_id
    total = server.api("GET", f"/api/saes/{sae}/dashboards")["total"]
    page.goto(f"{server.url}/dashboards/?sae_id={sae}")
    page.wait_for_selector("#runs tr")
    page.check("input[name=corpus][value=file]")
    page.fill("#d-file", "file-not-anyones")
    page.fill("#d-budget", "64")
    page.click("#d-start")
    error = page.locator(".notice.error")
    error.wait_for()
    assert "file-not-anyones" in error.inner_text()
    assert server.api("GET", f"/api/saes/{sae}/dashboards")["total"] == total
    # a budget over the page's own bound (DASHBOARD_MAX_TOKENS) is said before anything is sent
    page.check("input[name=corpus][value=sample]")
    page.fill("#d-budget", str(int(page.get_attribute("#d-budget", "max")) + 1))
    page.click("#d-start")
    page.wait_for_selector(".notice.error:has-text('Token budget must be')")
    assert server.api("GET", f"/api/saes/{sae}/dashboards")["total"] == total


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_odd_feature_urls_and_presets_are_refused_plainly(server, page):
    """Page URLs outside the pattern are 404s; an unknown SAE is the API's refusal, said in
    the page; a playground preset that is not a feature and a strength fills nothing, and
    markup in it stays text."""
    sae = server.sae_id
    assert _status(f"{server.url}/features/{sae}/3/") == 200
    for bad in (
        f"/features/{sae}/1234567890/",
        f"/features/{sae}/-1/",
        "/features/sae_a%2F..%2Fb/1/",
        "/features/x/1/",
    ):
        assert _status(server.url + bad) == 404, bad
    page.goto(f"{server.url}/features/sae_nope/3/")
    page.wait_for_selector(".notice.error")
    assert "SAE_NOT_FOUND" in page.inner_text("#f-label")
    assert [e for e in page.console.errors if "status of 404" not in e] == []
    page.console.errors.clear()

    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    markup = "<img src=x onerror=alert(1)>"
    page.goto(f"{server.url}/playground/?" + urllib.parse.urlencode({"sae_id": markup, "feature": "abc"}))
    error = page.locator(".notice.error")
    error.wait_for()
    assert "is not a feature index and a strength: ignored" in error.inner_text()
    assert page.locator("input[name=steer-mode][value=live]").is_checked()
    page.goto(
        f"{server.url}/playground/?" + urllib.parse.urlencode({"sae_id": markup, "feature": "4", "strength": "3"})
    )
    error = page.locator(".notice.error")
    error.wait_for()
    assert f"SAE {markup} is not attached" in error.inner_text()  # said as text
    assert page.input_value("#inline-features") == "4: 3"
    assert page.locator("#notices img").count() == 0 and dialogs == []
    page.console.assert_clean()
