"""``capture`` on /v1 (official openai client) and /api/captures, end to end."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import openai
import pytest
from django.core.management import call_command
from django.utils import timezone

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import CaptureSpec, GenerationJob, SamplingParams
from tests.engine.helpers import count_forwards
from tests.engine.tolerances import BATCH_ENCODE_ATOL, BATCH_ENCODE_RTOL
from tests.v1.helpers import assert_openai_error, request

CHAT = [{"role": "user", "content": "tell me about the fox"}]


def chat(client, capture, **kw):
    return client.chat.completions.create(
        model="tiny-llama",
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "capture": capture},
        **kw,
    )


def solo(server, meta) -> dict:
    """The same capture straight from the engine, on the prompt ids the response reports."""
    job = GenerationJob(
        "solo",
        prompt_token_ids=meta["prompt_token_ids"],
        sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        capture=CaptureSpec(layers=meta["layers"], positions=meta["positions"]),
    )
    return load_capture(server.engine.generate_sync(job).capture.data)


def test_inline_capture_through_the_openai_client(llama, openai_client):
    resp = chat(openai_client, {"layers": [0, 3], "positions": "all"})
    plain = chat(openai_client, None)
    assert resp.choices[0].message.content == plain.choices[0].message.content
    cap_obj = resp.model_extra["millm"]["capture"]
    assert cap_obj["inline"] is True and cap_obj["format"] == "safetensors"
    data = base64.b64decode(cap_obj["data"])
    assert len(data) == cap_obj["bytes"]
    cap = load_capture(data)
    meta = cap.meta
    assert meta["model"] == "tiny-llama" and meta["backend"] == "transformers"
    assert meta["layers"] == [0, 3] and meta["positions"] == "all"
    n = len(meta["prompt_token_ids"]) + resp.usage.completion_tokens - 1
    assert cap.positions.tolist() == list(range(n)) and cap.hidden[0].shape == (n, 64)
    want = solo(llama, meta)
    assert meta["completion_token_ids"] == want.meta["completion_token_ids"]
    for layer in (0, 3):
        np.testing.assert_allclose(
            cap.hidden[layer], want.hidden[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL
        )
    assert "capture" not in ((plain.model_extra or {}).get("millm") or {})


def test_stored_capture_is_listed_fetched_downloaded_and_deleted(llama, openai_client, settings):
    settings.CAPTURE_INLINE_MAX_BYTES = 0
    resp = chat(openai_client, {"layers": [1, 2], "positions": "completion"})
    cap_obj = resp.model_extra["millm"]["capture"]
    cid = cap_obj["id"]
    assert cap_obj["inline"] is False and cap_obj["url"] == f"/api/captures/{cid}/download"
    assert "data" not in cap_obj
    from monitoring.models import Capture

    row = Capture.objects.get(id=cid)
    assert row.request_id == resp.id and row.layers == [1, 2] and row.nbytes == cap_obj["bytes"]
    assert row.expires_at is not None
    base = llama.url
    listed = request(base, "GET", "/api/captures").json()["data"]
    assert [c["id"] for c in listed["captures"]] == [cid] and listed["total"] == 1
    detail = request(base, "GET", f"/api/captures/{cid}").json()["data"]
    assert detail["metadata"]["completion_token_ids"] and detail["metadata"]["layers"] == [1, 2]
    dl = request(base, "GET", f"/api/captures/{cid}/download")
    assert dl.status == 200 and len(dl.body) == cap_obj["bytes"]
    # a client that says what it wants gets it too (no 406 from content negotiation)
    typed = request(base, "GET", f"/api/captures/{cid}/download", headers={"Accept": "application/octet-stream"})
    assert typed.status == 200 and typed.body == dl.body
    cap = load_capture(dl.body)
    want = solo(llama, cap.meta)
    for layer in (1, 2):
        np.testing.assert_allclose(
            cap.hidden[layer], want.hidden[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL
        )
    files = [Path(settings.CAPTURE_DIR) / f"{cid}.safetensors", Path(settings.CAPTURE_DIR) / f"{cid}.json"]
    assert all(f.is_file() for f in files)
    assert request(base, "DELETE", f"/api/captures/{cid}").status == 200
    assert not any(f.exists() for f in files) and not Capture.objects.filter(id=cid).exists()
    gone = request(base, "GET", f"/api/captures/{cid}")
    assert gone.status == 404 and gone.json()["error"]["code"] == "CAPTURE_NOT_FOUND"


@pytest.mark.parametrize("bad", ["..%2F..%2Fmillm.sqlite3", "..", "abc", "0" * 32, "%2Fetc%2Fpasswd", "A" * 32])
def test_ids_that_are_not_ours_never_reach_a_file(llama, bad):
    for path in (f"/api/captures/{bad}", f"/api/captures/{bad}/download"):
        resp = request(llama.url, "GET", path)
        assert resp.status in (400, 404), (path, resp.status)
        assert b"SQLite" not in resp.body and b"root:" not in resp.body
    assert request(llama.url, "DELETE", f"/api/captures/{bad}").status in (400, 404)


def test_streaming_ends_with_a_capture_chunk_before_done(llama):
    resp = request(
        llama.base_url,
        "POST",
        "/chat/completions",
        {
            "model": "tiny-llama",
            "messages": CHAT,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "capture": {"layers": [2], "positions": "last"},
        },
    )
    frames = resp.frames()
    assert frames[-1] == "[DONE]"
    last = json.loads(frames[-2])
    assert last["choices"] == []
    cap = load_capture(base64.b64decode(last["millm"]["capture"]["data"]))
    assert cap.layers == [2] and len(cap.positions) == 1


def test_bad_captures_are_refused_with_400_and_nothing_runs(llama, openai_client, settings):
    with count_forwards(llama.engine.backend.model) as forwards:
        refusals(llama, openai_client, settings)
    assert forwards[0] == 0


def refusals(llama, openai_client, settings):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, {"layers": [0, 4]})
    assert exc.value.code == "invalid_parameter" and exc.value.param == "capture.layers"
    settings.CAPTURE_MAX_BYTES = 1000
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, {"layers": [0, 1, 2, 3], "positions": "all"})
    assert exc.value.code == "capture_too_large" and "bytes" in exc.value.message
    settings.CAPTURE_MAX_BYTES = 1 << 28
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": "hi", "n": 2, "capture": {"layers": [0]}},
    )
    assert_openai_error(resp, 400, "invalid_parameter", "capture")
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": "hi", "capture": {"layers": [0], "positions": "middle"}},
    )
    assert_openai_error(resp, 400, "invalid_parameter")


def test_completions_capture_and_prune(llama, settings):
    settings.CAPTURE_INLINE_MAX_BYTES = 0
    resp = request(
        llama.base_url,
        "POST",
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": "the quick brown fox",
            "max_tokens": 3,
            "temperature": 0,
            "capture": {"layers": [0], "positions": "prompt"},
        },
    )
    assert resp.status == 200, resp.body
    cid = resp.json()["millm"]["capture"]["id"]
    from monitoring.models import Capture

    Capture.objects.filter(id=cid).update(expires_at=timezone.now() - timedelta(seconds=1))
    call_command("prune_captures")
    assert not Capture.objects.filter(id=cid).exists()
    assert not (Path(settings.CAPTURE_DIR) / f"{cid}.safetensors").exists()
