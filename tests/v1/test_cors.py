"""CORS for browser clients of /v1 (Open WebUI in a browser, the UI's playground from
another origin): a preflight allows every X-miLLM-* request header the server reads, and a
response exposes every header the server sets — checked over a real socket, with the header
names found in the product code itself, so a new header cannot be left out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.v1.helpers import request

REPO = Path(__file__).resolve().parents[2]
ORIGIN = "http://webui.example"
# what the server reads from a request; every other X-miLLM-* name it writes in a response
REQUEST_HEADERS = {"X-miLLM-Lease", "X-miLLM-Load-Policy", "X-miLLM-Strict"}


def _product_header_names() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    names: set[str] = set()
    for f in files:
        if f.split("/", 1)[0] in ("tests", "docs", "benchmarks") or not f.endswith((".py", ".js", ".html")):
            continue
        names |= set(re.findall(r"X-miLLM-[A-Za-z]+(?:-[A-Za-z]+)*", (REPO / f).read_text(errors="ignore")))
    return names


def _listed(value: str) -> set[str]:
    return {h.strip().lower() for h in value.split(",") if h.strip()}


def test_preflight_allows_the_request_headers_and_responses_expose_the_rest(llama, settings):
    # a keyless server grants no foreign origin unless the operator names it
    settings.CORS_ALLOWED_ORIGINS = [ORIGIN]
    names = _product_header_names()
    response_headers = names - REQUEST_HEADERS
    assert REQUEST_HEADERS <= names and {"X-miLLM-Probe-Verdicts", "X-miLLM-Batch"} <= names
    preflight = request(
        llama.base_url,
        "OPTIONS",
        "/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": ", ".join(
                sorted(h.lower() for h in REQUEST_HEADERS | {"Authorization", "Content-Type"})
            ),
        },
    )
    assert preflight.status == 200, preflight.body[:300]
    allowed = _listed(preflight.headers["access-control-allow-headers"])
    assert {h.lower() for h in REQUEST_HEADERS | {"Authorization", "Content-Type"}} <= allowed
    assert "post" in _listed(preflight.headers["access-control-allow-methods"])
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "seed": 1,
            "extra_messages": [[{"role": "user", "content": "yo"}]],
        },
        headers={"Origin": ORIGIN},
    )
    assert resp.status == 200, resp.body[:300]
    exposed = _listed(resp.headers["access-control-expose-headers"])
    assert {h.lower() for h in response_headers | {"Retry-After"}} <= exposed
    # the headers this answer carries are among them (X-miLLM-Batch: extra_messages)
    sent = {h for h in resp.headers if h.startswith("x-millm-")}
    assert "x-millm-batch" in sent and sent <= exposed
