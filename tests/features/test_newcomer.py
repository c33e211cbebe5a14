"""Issue 34's "done when", as a newcomer follows docs/features.md from the README: the
quick start's server (the demo model loaded, its SAE attached, SQLite in a fresh data
directory, ``manage.py serve`` in a process of its own), then, through HTTP only, a
dashboard run on the offline sample corpus, the densest feature's dashboard and its page
in the UI, a search that finds it by a word of its top contexts, and a steered chat
completion through the official ``openai`` client that steers with it."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.fixtures.served import quickstart_serve

DEMO_MODEL = "smollm2-135m"
DEMO_SAE = "smollm2-135m-L12-demo"
BUDGET = 2048  # corpus tokens: 32 contexts of 64
PROMPT = [{"role": "user", "content": "Tell me about your weekend."}]


def call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def get_text(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def demo_server(demo_assets, tmp_path_factory):
    """``scripts/run``'s server: the demo model loaded and its SAE attached at start-up."""
    data = tmp_path_factory.mktemp("newcomer-data")
    with quickstart_serve(
        data, assets_root=demo_assets.root, model=DEMO_MODEL, sae=DEMO_SAE, tiny_only=False, timeout_s=300
    ) as (url, _):
        yield url, data / "serve.log"


def wait_for_run(url: str, run_id: str, log) -> dict:
    """Poll the run until it ends (the documented way without a WebSocket)."""
    deadline = time.monotonic() + 600
    while True:
        status, body = call(f"{url}/api/dashboards/{run_id}")
        assert status == 200, body
        run = body["data"]
        if run["status"] in ("completed", "failed", "cancelled"):
            return run
        assert time.monotonic() < deadline, f"run still {run['status']}: {log.read_text()[-3000:]}"
        time.sleep(0.5)


def word_of(feature: dict) -> str:
    """A word (letters only, 3 or more) that one of the feature's top contexts holds at its
    max token, else one of its top logit tokens: what a researcher reads off its page."""
    board = feature["dashboard"]
    tokens = [ctx["tokens"][ctx["max_position"]] for ctx in board["top_contexts"]]
    for token in tokens + [e["token"] for e in board["logit_top"]]:
        word = re.sub(r"^[\sĠ▁]+", "", token).strip()
        if re.fullmatch(r"[A-Za-z]{3,}", word):
            return word.lower()
    raise AssertionError(f"no word at the max of feature {feature['index']}'s top contexts: {tokens}")


def test_a_newcomer_builds_dashboards_finds_a_feature_and_steers_with_it(demo_server):
    from openai import OpenAI

    url, log = demo_server
    status, body = call(url + "/api/saes")
    assert status == 200, body
    (sae,) = [s for s in body["data"]["saes"] if s["name"] == DEMO_SAE]

    # 1. build dashboards over the offline sample corpus
    status, body = call(f"{url}/api/saes/{sae['id']}/dashboards", "POST", {"corpus": "sample", "token_budget": BUDGET})
    assert status == 202, body
    started = body["data"]["run"]
    assert started["status"] in ("queued", "running") and started["complete"] is False
    run = wait_for_run(url, started["id"], log)
    assert (run["status"], run["complete"], run["error"]) == ("completed", True, None), run
    assert 0 < run["tokens_done"] <= BUDGET and run["summary"]["tokens"] == run["tokens_done"]

    # 2. the densest feature: the summary names the dense ones, each feature's GET its figures
    dense = run["summary"]["dense"]
    assert dense, run["summary"]
    features = {}
    for index in dense:
        status, body = call(f"{url}/api/saes/{sae['id']}/features/{index}")
        assert status == 200, body
        features[index] = body["data"]
    index = max(features, key=lambda i: features[i]["dashboard"]["density"])
    feature = features[index]
    board = feature["dashboard"]
    assert feature["run_id"] == run["id"]
    # the figures agree with one another as their definitions say
    assert board["density"] == pytest.approx(board["count"] / run["tokens_done"])
    assert board["density"] > 0.1 and board["max"] >= board["mean"] > 0
    assert sum(board["histogram"]["counts"]) == board["count"]
    assert board["top_contexts"][0]["max_activation"] == pytest.approx(board["max"])
    assert board["logit_top"] and board["logit_bottom"]

    # 3. its page in the browser UI
    status, html = get_text(f"{url}/features/{sae['id']}/{index}/")
    assert status == 200 and sae["id"] in html

    # 4. search by a word of its top contexts finds it
    word = word_of(feature)
    hits, total, offset = [], None, 0
    while total is None or offset < total:  # every page: a common word matches many features
        query = urllib.parse.urlencode({"q": word, "limit": 200, "offset": offset})
        status, body = call(f"{url}/api/saes/{sae['id']}/features?{query}")
        assert status == 200, body
        hits += body["data"]["features"]
        total, offset = body["data"]["total"], offset + 200
    found = [h for h in hits if h["index"] == index]
    assert found, (word, total, hits[:10])
    assert f"token:{word}" in found[0]["matched"], found
    # a made-up word finds nothing (the search is not answering every feature)
    status, body = call(f"{url}/api/saes/{sae['id']}/features?q=zzqxjv")
    assert status == 200 and body["data"]["total"] == 0, body

    # 5. steer with it through /v1, with the official client
    with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:

        def chat(features: list[dict]):
            return client.chat.completions.create(
                model=DEMO_MODEL,
                messages=PROMPT,
                max_tokens=24,
                temperature=0,
                extra_body={"steering": {"features": features}},
            )

        plain = chat([])
        # a few times its own largest activation, within the strength limit (±200)
        strength = float(min(200, max(20, round(3 * board["max"]))))
        steered = chat([{"index": index, "strength": strength}])
    millm = steered.model_extra["millm"]
    counts = [c for c in millm["steering_apply_count"] if c["sae_id"] == sae["id"]]
    assert counts and counts[0]["count"] > 0, millm
    assert millm["steering"]["entries"] == [
        {"sae_id": sae["id"], "layer": sae["attached_layers"][0], "features": [{"index": index, "strength": strength}]}
    ]
    # positive control: the steer changed the greedy answer
    assert steered.choices[0].message.content != plain.choices[0].message.content, (index, strength, plain)
