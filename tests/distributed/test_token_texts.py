"""Token texts come from the engine: in the distributed topology (``manage.py serve`` and
``manage.py run_engine`` as separate processes on PostgreSQL and Redis) the web tier holds
no tokenizer, yet /v1 shows real text wherever it shows tokens: the echoed prompt, each
prompt and completion token in ``logprobs``, ``text_offset``, and the ``token`` of every
``return_sae_activations`` position.

The model's files are moved away once the engine has loaded them, so no process could
read the tokenizer from disk while the requests run, and the web server never maps the
``tokenizers`` library at all. What the texts must be is computed here, independently,
with the ``tokenizers`` library from the model directory's ``tokenizer.json``.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from tokenizers import Tokenizer

from tests.distributed.conftest import Proc
from tests.distributed.test_processes import (  # noqa: F401 - the cluster fixture
    Cluster,
    cluster,
    wait_for,
)

pytestmark = pytest.mark.slow

TOKENIZERS_LIB = "tokenizers.abi3.so"  # the tokenizers package's native library
PROMPT = "the cat sat on the mat and looked at the dog"
MAX_TOKENS = 4


def _text(tok: Tokenizer, ids: list[int]) -> str:
    # how the engine renders text: nothing skipped, no clean-up of spaces
    return tok.decode(ids, skip_special_tokens=False)


def _offsets_index_text(lp: dict[str, Any], text: str) -> None:
    """OpenAI's text_offset indexes the choice's text: every token is found at its offset,
    in order, and together they spell the text; a BOS the echoed text leaves out (a prompt
    given as text) is the one token not there."""
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(offsets) == len(tokens) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    placed = [t for t, o in zip(tokens, offsets, strict=True) if text[o : o + len(t)] == t]
    absent = [] if text.startswith("<s>") else ["<s>"]
    assert [t for t in tokens if t not in absent] == placed, (lp, text)
    assert "".join(placed) == text and offsets == sorted(offsets), (lp, text)


def _post(c: Cluster, path: str, body: dict[str, Any], bodies: list[str]) -> dict[str, Any]:
    resp = c.api("web", "POST", path, json=body)
    bodies.append(resp.text)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream_text(c: Cluster, body: dict[str, Any], bodies: list[str]) -> str:
    text = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{c.webs['web']}/v1/completions", json={**body, "stream": True}) as resp,
    ):
        assert resp.status_code == 200, resp.read().decode()
        for line in resp.iter_lines():
            bodies.append(line)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[len("data: ") :])
            assert "error" not in obj, obj
            text += [ch["text"] for ch in obj["choices"]]
    return "".join(text)


def test_token_texts_come_from_the_engine(
    cluster: Cluster,
    procs: list[Proc],  # noqa: F811
    tiny_assets,
):
    c = cluster
    source = Path(tiny_assets.models["tiny-llama"].path)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    # the model is served from a copy of its own, moved away once the engine has it
    files = c.tmp / "tiny-llama"
    shutil.copytree(source, files)
    c.manage(
        "shell",
        "-c",
        textwrap.dedent(f"""
        from registry.models import Model
        assert Model.objects.filter(name="tiny-llama").update(local_path={str(files)!r}) == 1
        """),
    )
    engine = c.start_engine()
    web = c.start_web("web")
    wait_for("the engine's heartbeat", c.serving, 120, procs)
    wait_for("the web server", lambda: c.live("web"), 60, procs)

    bodies: list[str] = []  # every response body, searched for a placeholder at the end
    base = {"model": "tiny-llama", "temperature": 0, "ignore_eos": True, "max_tokens": MAX_TOKENS}
    # an on-demand load (the web process asks the engine over Redis), then an SAE
    _post(c, "/v1/completions", {**base, "prompt": "hello", "max_tokens": 1}, bodies)
    assert c.serving()["status"]["model_id"] == "tiny-llama"
    saes = c.api("web", "GET", "/api/saes").json()["data"]["saes"]
    sae_id = next(s["id"] for s in saes if s["name"] == "tiny-llama-L1-relu")
    resp = c.api("web", "POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert resp.status_code == 200, resp.text
    files.rename(c.tmp / "tiny-llama-moved")  # from here on no process can read them

    ids = tok.encode(PROMPT).ids  # with <s>, as the engine encodes a completion prompt
    assert ids[0] == tok.token_to_id("<s>") and len(ids) > 3
    prompt_tokens = [_text(tok, [i]) for i in ids]

    # --- (3) return_sae_activations: every position's token, prompt and completion
    body = _post(
        c,
        "/v1/completions",
        {**base, "prompt": PROMPT, "return_sae_activations": {"sae_id": sae_id, "top_k": 2, "positions": "all"}},
        bodies,
    )
    acts = body["millm"]["sae_activations"]
    assert (acts["sae_id"], acts["layer"], acts["prompt_tokens"]) == (sae_id, 1, len(ids))
    rows = acts["positions"]
    assert [r["position"] for r in rows] == list(range(len(rows)))
    assert len(rows) >= len(ids) + MAX_TOKENS - 1, rows
    assert [r["token_id"] for r in rows[: len(ids)]] == ids
    for row in rows:
        assert row["token"] == _text(tok, [row["token_id"]]), row
    completion = body["choices"][0]["text"]
    completion_ids = [r["token_id"] for r in rows[len(ids) :]]
    # the completion's text is its tokens' text (the rows read all but maybe the last)
    assert completion.startswith(_text(tok, completion_ids)), (completion, completion_ids)

    # --- (1) echo with logprobs 2: the prompt, then each token's text and its offset
    body = _post(c, "/v1/completions", {**base, "prompt": PROMPT, "echo": True, "logprobs": 2}, bodies)
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert choice["text"] == PROMPT + completion  # greedy: the same completion as above
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == prompt_tokens
    assert len(lp["tokens"]) == len(ids) + MAX_TOKENS
    generated = lp["tokens"][len(ids) :]
    assert "".join(generated) == completion
    assert generated[: len(completion_ids)] == [_text(tok, [i]) for i in completion_ids]
    _offsets_index_text(lp, choice["text"])
    # the alternatives name tokens by their text too, the chosen one among them
    assert lp["top_logprobs"][0] is None
    for token, top in zip(lp["tokens"][1:], lp["top_logprobs"][1:], strict=True):
        assert token in top and 1 <= len(top) <= 3, (token, top)
        assert set(top) <= {_text(tok, [i]) for i in range(tok.get_vocab_size())}, top

    # --- (2) a prompt given as token ids: the engine writes its text
    id_prompt = tok.encode("the dog ran to the cat").ids
    id_text = _text(tok, id_prompt)
    assert id_text.startswith("<s>the dog")
    body = _post(c, "/v1/completions", {**base, "prompt": id_prompt, "echo": True, "logprobs": 0}, bodies)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"][: len(id_prompt)] == [_text(tok, [i]) for i in id_prompt]
    assert choice["text"] == id_text + "".join(lp["tokens"][len(id_prompt) :])
    _offsets_index_text(lp, choice["text"])
    # streamed, the first chunk carries the prompt's text (the first token's event)
    streamed = _stream_text(c, {**base, "prompt": id_prompt, "echo": True}, bodies)
    assert streamed == choice["text"]

    # nowhere a placeholder for a token the web tier could not spell
    for text in bodies:
        assert "token_id:" not in text, text
    # the web server never had a tokenizer; the engine has one (the control)
    assert not web.maps_library(TOKENIZERS_LIB)
    assert engine.maps_library(TOKENIZERS_LIB)
    assert web.alive() and engine.alive()
