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
import urllib.parse
import urllib.request

import numpy as np
import pytest

from tests.ui.conftest import screenshot
from tests.ui.test_features_pages import held_server  # noqa: F401  (a fixture: a server whose engine holds)

ROW = "#runs tr[data-run-id='{id}']"
# every value the run's bar shows, recorded in the page as the rows change
RECORD = """() => {
  window.__bars = [];
  const seen = () => {
    for (const tr of document.querySelectorAll('#runs tr[data-run-id]')) {
      const bar = tr.querySelector('progress');
      window.__bars.push([tr.dataset.runId, tr.dataset.status, bar ? Number(bar.value) : null]);
    }
  };
  new MutationObserver(seen).observe(document.querySelector('#runs'), {childList: true, subtree: true});
}"""
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
    row = page.locator(ROW.format(id=run_id))
    row.wait_for()
    page.wait_for_selector(ROW.format(id=run_id) + "[data-status=completed]", timeout=240_000)
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
            assert shown == alone["choices"][0]["text"], (p, s)
        status, alone = server.call(
            "POST",
            "/v1/completions",
            {**body, "steering": {"features": []}},
            timeout=60,
        )
        assert defaults[p]["text"] == alone["choices"][0]["text"]
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
