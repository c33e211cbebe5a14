"""Speculative decoding through /v1 with the official client: a server whose model loads
with SPECULATIVE_MODEL answers greedy requests with plain decoding's text, reports the
draft figures under ``millm.speculative``, in the Prometheus counters and in the health
capabilities; a sampled request says why it decoded plainly."""

from __future__ import annotations

import re

import pytest

from tests.v1.conftest import model_resident
from tests.v1.helpers import request

MESSAGES = [{"role": "user", "content": "the cat sat on the mat and"}]


def _reload(server, settings, draft: str) -> None:
    from orchestration.services import model_load, model_unload
    from registry.models import Model

    settings.SPECULATIVE_MODEL = draft
    settings.SPECULATIVE_NUM_TOKENS = 4
    row = Model.objects.get(name="tiny-llama")
    model_resident(server, "tiny-llama")
    model_unload(model=Model.objects.get(pk=row.pk))
    model_load(model=Model.objects.get(pk=row.pk))


def _drafted(url: str) -> tuple[float, float]:
    text = request(url, "GET", "/api/health/metrics/prometheus").body.decode()
    found = {}
    for kind in ("drafted", "accepted"):
        m = re.search(
            r'millm_speculative_tokens_total\{[^}]*kind="' + kind + r'"[^}]*model="tiny-llama"'
            r"[^}]*\} ([0-9.e+]+)",
            text,
        )
        found[kind] = float(m.group(1)) if m else 0.0
    return found["drafted"], found["accepted"]


@pytest.fixture
def speculative(v1_server, settings):
    _reload(v1_server, settings, "self:layers=2")
    yield v1_server
    v1_server.wait_idle()
    _reload(v1_server, settings, "")  # the next tests get the plain model


def test_speculative_decoding_through_v1(speculative, openai_client, settings):
    before = _drafted(speculative.url)
    got = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=32, temperature=0)
    spec = got.model_extra["millm"]["speculative"]
    assert spec["used"] is True and spec["source"] == "self:layers=2" and spec["num_tokens"] == 4
    assert spec["drafted"] > 0 and spec["acceptance_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    after = _drafted(speculative.url)
    assert (after[0] - before[0], after[1] - before[1]) == (spec["drafted"], spec["accepted"])
    caps = request(speculative.url, "GET", "/api/health/inference").json()["data"]["capabilities"]
    assert caps["speculative_decoding"] is True and caps["speculative_model"] == "self:layers=2"

    sampled = openai_client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0.7, seed=3
    )
    assert sampled.model_extra["millm"]["speculative"] == {
        "used": False,
        "source": "self:layers=2",
        "num_tokens": 4,
        "drafted": 0,
        "accepted": 0,
        "acceptance_rate": None,
        "reason": "sampling",
    }

    # the same greedy request on the model loaded without a draft: the same answer
    _reload(speculative, settings, "")
    plain = openai_client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=32, temperature=0)
    assert plain.choices[0].message.content == got.choices[0].message.content
    assert "millm" not in (plain.model_extra or {}) or plain.model_extra["millm"] is None
    caps = request(speculative.url, "GET", "/api/health/inference").json()["data"]["capabilities"]
    assert caps["speculative_decoding"] is False
