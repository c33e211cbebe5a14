"""The Python client (integrations/millm_client.py) against the live server: what it
returns equals what the raw ``openai`` client and the artifact files give."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gpu_engine.api.artifacts import load_capture
from integrations.millm_client import MillmClient, MillmError

CHAT = [{"role": "user", "content": "tell me about the fox"}]


@pytest.fixture
def client(llama):
    return MillmClient(llama.base_url)


def test_capture_inline_and_stored_equal_the_raw_response(llama, client, openai_client, settings):
    text, cap = client.capture(
        "tiny-llama", messages=CHAT, layers=[0, 2], positions="all", max_tokens=5, temperature=0, ignore_eos=True
    )
    raw = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "capture": {"layers": [0, 2], "positions": "all"}},
    )
    want = load_capture(base64.b64decode(raw.model_extra["millm"]["capture"]["data"]))
    assert text == raw.choices[0].message.content and text
    assert cap.layers == [0, 2] and cap.positions.tolist() == want.positions.tolist()
    for layer in (0, 2):
        np.testing.assert_array_equal(cap.hidden[layer], want.hidden[layer])

    settings.CAPTURE_INLINE_MAX_BYTES = 0  # stored: the client downloads it
    out = client.generate(
        "tiny-llama",
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        capture={"layers": [1], "positions": "last"},
    )
    obj = out.millm["capture"]
    assert obj["inline"] is False
    stored = client.fetch_capture(obj)
    assert stored.meta["layers"] == [1] and stored.hidden[1].shape == (1, 64)
    np.testing.assert_array_equal(client.download_capture(obj["id"]).hidden[1], stored.hidden[1])
    with pytest.raises(MillmError) as exc:
        client.download_capture("0" * 32)
    assert exc.value.code == "CAPTURE_NOT_FOUND"


def test_completions_and_extension_fields_pass_through(llama, client):
    plain = client.generate("tiny-llama", prompt="the sea", max_tokens=4, temperature=0, ignore_eos=True)
    assert plain.text and plain.response.usage.completion_tokens == 4
    with pytest.raises(ValueError):
        client.generate("tiny-llama", max_tokens=1)


def test_analyze_and_analyze_capture_equal_the_raw_answers(llama, client, openai_client, settings):
    params = {"layers": [1], "reduce": "norm", "positions": "all"}
    entry = client.analyze(
        "tiny-llama", "hidden_states", params=params, messages=CHAT, max_tokens=4, temperature=0, ignore_eos=True
    )
    raw = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "analyze": {"name": "hidden_states", "params": params}},
    )
    assert entry == raw.model_extra["millm"]["analysis"][0] and entry["result"]["layers"]["1"] > 0
    settings.CAPTURE_INLINE_MAX_BYTES = 0
    out = client.generate(
        "tiny-llama",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        capture={"layers": [1], "positions": "all"},
    )
    cap = client.fetch_capture(out.millm["capture"])
    again = client.analyze_capture(out.millm["capture"]["id"], "hidden_states", params)
    assert again["result"]["layers"]["1"] == pytest.approx(
        float(np.linalg.norm(cap.hidden[1].astype(np.float64))), rel=1e-6
    )
    with pytest.raises(MillmError) as exc:
        client.analyze_capture(out.millm["capture"]["id"], "no_such_analyzer")
    assert exc.value.code == "UNKNOWN_ANALYZER"
