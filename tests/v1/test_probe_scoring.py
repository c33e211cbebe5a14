"""Scoring inputs with probes without generating (docs/monitoring.md, "Scoring inputs with
probes"): ``POST /api/probes/score``, its /v1 twin and Batch API lines calling it.

Every expected score is computed here: the test tokenises each input with the model's own
tokenizer, runs its own float64 forward of a second copy of the tiny model, encodes with
its own float64 SAE (``RefSAE``) and takes the probe's dot product in numpy."""

from __future__ import annotations

import io
import json
import math
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import RefSAE, count_forwards
from tests.engine.test_capture import reference_blocks
from tests.engine.tolerances import PROBE_ATOL
from tests.v1.conftest import attach
from tests.v1.helpers import assert_openai_error, request

SAE = "tiny-llama-L1-relu"
TEXTS = ["the sea was calm that night", "a dog ran over the hill and kept going"]
PROMPT_IDS = [5, 17, 23, 42, 8, 11, 60, 3, 29, 14]
MESSAGES = [{"role": "user", "content": "what colour is the sky"}, {"role": "assistant", "content": "blue, mostly"}]


@pytest.fixture(scope="module")
def hf64(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float64, local_files_only=True).eval()
    return asset, model, AutoTokenizer.from_pretrained(str(asset.path))


def api(server, method, path, body=None, **kw):
    return request(server.url, method, path, body, **kw)


def ids_of(hf64, item) -> list[int]:
    _, _, tok = hf64
    if isinstance(item, str) or "text" in item:
        return list(tok(item if isinstance(item, str) else item["text"])["input_ids"])
    if "token_ids" in item:
        return list(item["token_ids"])
    text = tok.apply_chat_template(item["messages"], add_generation_prompt=False, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def rows_of(hf64, item, layer: int) -> np.ndarray:
    """Block ``layer``'s output at every row of the input, from the test's forward."""
    asset, model, _ = hf64
    return reference_blocks(asset, model, ids_of(hf64, item))[layer]


def logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.fixture
def probes(llama, hf64, tiny_assets):
    """An SAE-feature probe at layer 1 (last row) and a hidden-state probe at layer 2
    (mean), both validated; returns how the test scores each on an input."""
    sae = attach(SAE, 1)
    ref_sae = RefSAE(tiny_assets.saes[SAE])
    acts = ref_sae.encode(rows_of(hf64, TEXTS[0], 1))
    features = [int(i) for i in np.argsort(-acts[-1])[:3]]
    rng = np.random.default_rng(11)
    w_sae = rng.uniform(-1, 1, size=len(features))
    mean, std = rng.normal(size=3) * 0.1, rng.uniform(0.5, 2, size=3)
    w_hidden = rng.normal(size=rows_of(hf64, TEXTS[0], 2).shape[1]) * 0.1

    def sae_rows(item):
        return ((ref_sae.encode(rows_of(hf64, item, 1))[:, features] - mean) / std) @ w_sae + 0.25

    def hidden_rows(item):
        return rows_of(hf64, item, 2) @ w_hidden - 0.5

    first = float(sae_rows(TEXTS[0])[-1])
    assert abs(first) > 1e-3  # the probe reads something
    made = api(
        llama,
        "POST",
        "/api/probes",
        {
            "name": "topic",
            "sae_id": sae.id,
            "layer": 1,
            "features": features,
            "weights": w_sae.tolist(),
            "bias": 0.25,
            "norm_mean": mean.tolist(),
            "norm_std": std.tolist(),
            "threshold": first - 0.01,
        },
    )
    assert made.status == 201, made.body
    made = api(
        llama,
        "POST",
        "/api/probes",
        {"name": "hidden", "layer": 2, "weights": w_hidden.tolist(), "bias": -0.5, "positions": "mean"},
    )
    assert made.status == 201, made.body
    for name in ("topic", "hidden"):
        assert api(llama, "POST", f"/api/probes/{name}/validate").status == 200
    return {"topic": sae_rows, "hidden": hidden_rows}


def test_scores_equal_an_independent_float64_forward(llama, hf64, probes):
    from monitoring.models import ProbeVerdict

    inputs = [TEXTS[0], {"text": TEXTS[1]}, {"token_ids": PROMPT_IDS}, {"messages": MESSAGES}]
    with count_forwards(llama.engine.backend.model) as forwards:
        resp = api(
            llama,
            "POST",
            "/api/probes/score",
            {"probes": ["topic", {"name": "hidden", "positions": "max"}], "inputs": inputs},
        )
    assert resp.status == 200, resp.body
    body = resp.json()
    assert body["success"] is True and body["error"] is None
    data = body["data"]
    assert data["model"] == "tiny-llama" and len(data["data"]) == len(inputs)
    # one forward pass per input at most (the engine may share them), nothing decoded
    assert data["forward_passes"] == len(inputs) and 1 <= forwards[0] <= len(inputs)
    total = 0
    for i, (item, result) in enumerate(zip(inputs, data["data"])):
        n = len(ids_of(hf64, item))
        total += n
        assert result["index"] == i and result["prompt_tokens"] == n
        topic, hidden = result["probes"]
        want_topic = float(probes["topic"](item)[-1])
        want_hidden = float(probes["hidden"](item).max())
        assert (topic["name"], hidden["name"]) == ("topic", "hidden")
        assert topic["scored"] and topic["rows"] == n and topic["positions"] == "last"
        assert topic["score"] == pytest.approx(want_topic, abs=PROBE_ATOL)
        assert topic["probability"] == pytest.approx(logistic(want_topic), abs=PROBE_ATOL)
        assert topic["verdict"] is (want_topic >= topic["threshold"])
        assert hidden["scored"] and hidden["rows"] == n and hidden["positions"] == "max"
        assert hidden["score"] == pytest.approx(want_hidden, abs=PROBE_ATOL)
        assert hidden["threshold"] is None and "verdict" not in hidden
    assert data["data"][0]["probes"][0]["verdict"] is True  # its bar sits just under it
    assert data["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert resp.headers["x-millm-steering"] == "none"
    assert not ProbeVerdict.objects.exists()  # scoring records nothing


def test_live_steering_does_not_reach_a_score(llama, hf64, probes):
    from registry.models import SAE as SAERow

    sae = SAERow.objects.get(name=SAE)
    want = float(probes["topic"](TEXTS[1])[-1])
    steer = api(llama, "POST", "/api/saes/steering", {"sae_id": sae.id, "feature_idx": 3, "value": 150.0})
    assert steer.status == 200, steer.body
    try:
        # positive control: a generation under the live steering reads a moved probe
        steered = request(
            llama.base_url,
            "POST",
            "/completions",
            {"model": "tiny-llama", "prompt": TEXTS[1], "max_tokens": 1, "temperature": 0, "probes": ["topic"]},
        ).json()["millm"]["probes"][0]["score"]
        assert abs(steered - want) > 10 * PROBE_ATOL
        resp = api(llama, "POST", "/api/probes/score", {"probes": ["topic"], "inputs": [TEXTS[1]]})
        (v,) = resp.json()["data"]["data"][0]["probes"]
        assert v["score"] == pytest.approx(want, abs=PROBE_ATOL)
    finally:
        api(llama, "DELETE", f"/api/saes/steering?sae_id={sae.id}")


def test_armed_probes_and_the_v1_twin(llama, hf64, probes):
    assert api(llama, "POST", "/api/probes/hidden/arm").status == 200
    via_api = api(llama, "POST", "/api/probes/score", {"inputs": [TEXTS[0]]})
    assert via_api.status == 200, via_api.body
    (v,) = via_api.json()["data"]["data"][0]["probes"]
    assert v["name"] == "hidden"
    assert v["score"] == pytest.approx(float(probes["hidden"](TEXTS[0]).mean()), abs=PROBE_ATOL)
    via_v1 = request(llama.base_url, "POST", "/probes/score", {"model": "tiny-llama", "inputs": [TEXTS[0]]})
    assert via_v1.status == 200, via_v1.body
    assert via_v1.json()["data"] == via_api.json()["data"]["data"]
    assert via_v1.json()["object"] == "probe_score"


def test_refusals_run_nothing(llama, probes, admission):
    from monitoring.models import Probe

    Probe.objects.create(id="prb_unvalidated0000000", name="stale", basis="hidden_states", layer=2, weights=[0.0] * 4)
    refusals = [
        ({"probes": ["topic"]}, "inputs"),
        ({"probes": ["topic"], "inputs": []}, "inputs"),
        ({"probes": ["topic"], "inputs": ["   "]}, "inputs[0]"),
        ({"probes": ["topic"], "inputs": [{"text": ""}]}, "inputs[0]"),
        ({"probes": ["topic"], "inputs": [{"text": "a", "token_ids": [1]}]}, "inputs[0]"),
        ({"probes": ["topic"], "inputs": [{"token_ids": [-1]}]}, "inputs[0]"),
        ({"probes": ["topic"], "inputs": ["x"] * 65}, "inputs"),
        ({"probes": ["nope"], "inputs": ["x"]}, "probes"),
        ({"probes": [], "inputs": ["x"]}, "probes"),
        ({"probes": ["topic", "topic"], "inputs": ["x"]}, "probes"),
        ({"probes": ["topic"], "inputs": ["x"], "windows": ["all"]}, None),
        ({"inputs": ["x"]}, "probes"),  # none named, none armed
        ({"model": "tiny-llama@nice", "probes": ["topic"], "inputs": ["x"]}, "model"),
    ]
    with count_forwards(llama.engine.backend.model) as forwards:
        for body, param in refusals:
            resp = api(llama, "POST", "/api/probes/score", body)
            assert resp.status == 400, (body, resp.body)
            error = resp.json()["error"]
            assert error["code"] == "INVALID_PROBE_SCORE_REQUEST", (body, error)
            assert resp.json()["success"] is False and resp.json()["data"] is None
            assert "Traceback" not in error["message"]
            if param is not None:
                assert error["details"]["param"] == param, (body, error)
        bad_json = api(llama, "POST", "/api/probes/score", raw=b"{nope")
        assert bad_json.json()["error"]["code"] == "INVALID_PROBE_SCORE_REQUEST"
        stale = api(llama, "POST", "/api/probes/score", {"probes": ["stale"], "inputs": ["x"]})
        assert stale.status == 409 and stale.json()["error"]["code"] == "UNVALIDATED_PROBE"
        other = api(llama, "POST", "/api/probes/score", {"model": "tiny-gemma2", "probes": ["topic"], "inputs": ["x"]})
        assert other.status == 409 and other.json()["error"]["code"] == "MODEL_NOT_RESIDENT"
        assert llama.engine.status().model_id == "tiny-llama"  # never a load
        assert_openai_error(
            request(llama.base_url, "POST", "/probes/score", {"probes": ["topic"], "inputs": ["x"]}),
            400,
            "invalid_probe_score_request",
            "model",
        )
        assert_openai_error(
            request(
                llama.base_url, "POST", "/probes/score", {"model": "tiny-llama", "probes": ["nope"], "inputs": ["x"]}
            ),
            400,
            "invalid_probe_score_request",
            "probes",
        )
        # a full queue: refused at once with Retry-After, as a /v1 generation is
        controller = admission(slots=1, pending=0)
        held = controller.try_acquire()
        try:
            full = api(llama, "POST", "/api/probes/score", {"probes": ["topic"], "inputs": ["x"]})
        finally:
            held.release()
        assert full.status == 503 and full.json()["error"]["code"] == "QUEUE_FULL"
        assert int(full.headers["retry-after"]) >= 1
    assert forwards[0] == 0


# --------------------------------------------------------------------------- Batch API


def test_a_batch_of_probe_scoring_lines_answers_each_once(llama, hf64, probes, openai_client):
    from batches.models import Batch
    from core.runtime import runtime
    from tests.v1.test_batches import CountingEngine

    texts = [f"{TEXTS[i % 2]} {'again ' * (i // 2)}".strip() for i in range(6)]
    rows = [
        {
            "custom_id": f"s-{i}",
            "method": "POST",
            "url": "/v1/probes/score",
            "body": {"model": "tiny-llama", "probes": ["topic", "hidden"], "inputs": [t]},
        }
        for i, t in enumerate(texts)
    ]
    rows.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/probes/score",
            "body": {"model": "tiny-llama", "probes": ["nope"], "inputs": ["x"]},
        }
    )
    counting = CountingEngine(runtime().engine)
    with runtime().replaced(engine=counting):
        file = openai_client.files.create(
            file=("score.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())), purpose="batch"
        )
        batch = openai_client.batches.create(
            input_file_id=file.id, endpoint="/v1/probes/score", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while (done := openai_client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
    out = [json.loads(x) for x in openai_client.files.content(done.output_file_id).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"s-{i}" for i in range(6)]
    for o in out:
        text = texts[int(o["custom_id"].split("-")[1])]
        assert counting.started[json.dumps(text)] == 1  # one pass per line, never again
        resp = o["response"]
        assert resp["status_code"] == 200
        topic, hidden = resp["body"]["data"][0]["probes"]
        assert topic["score"] == pytest.approx(float(probes["topic"](text)[-1]), abs=PROBE_ATOL)
        assert hidden["score"] == pytest.approx(float(probes["hidden"](text).mean()), abs=PROBE_ATOL)
    (err,) = [json.loads(x) for x in openai_client.files.content(done.error_file_id).content.splitlines()]
    assert err["custom_id"] == "bad"
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "invalid_probe_score_request"
    assert Batch.objects.get(id=batch.id).endpoint == "/v1/probes/score"


def test_the_python_client_scores_as_the_route_does(llama, probes):
    from integrations.millm_client import MillmClient, MillmError

    client = MillmClient(llama.base_url)
    got = client.score_probes([TEXTS[0], {"token_ids": PROMPT_IDS}], ["topic"])
    raw = api(
        llama, "POST", "/api/probes/score", {"probes": ["topic"], "inputs": [TEXTS[0], {"token_ids": PROMPT_IDS}]}
    )
    assert got == [item["probes"] for item in raw.json()["data"]["data"]]
    assert got[0][0]["score"] == pytest.approx(float(probes["topic"](TEXTS[0])[-1]), abs=PROBE_ATOL)
    with pytest.raises(MillmError) as refused:
        client.score_probes([], ["topic"])
    assert refused.value.code == "INVALID_PROBE_SCORE_REQUEST"


def test_batch_lines_naming_probes_get_the_verdicts_the_route_gives(llama, probes, openai_client):
    body = {
        "model": "tiny-llama",
        "prompt": TEXTS[1],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "probes": ["topic"],
    }
    rows = [{"custom_id": "c0", "method": "POST", "url": "/v1/completions", "body": body}]
    file = openai_client.files.create(
        file=("c.jsonl", io.BytesIO((json.dumps(rows[0]) + "\n").encode())), purpose="batch"
    )
    batch = openai_client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (done := openai_client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, done
        time.sleep(0.1)
    (line,) = [json.loads(x) for x in openai_client.files.content(done.output_file_id).content.splitlines()]
    sync = request(llama.base_url, "POST", "/completions", body)
    (want,) = sync.json()["millm"]["probes"]
    (got,) = line["response"]["body"]["millm"]["probes"]
    assert got["score"] == want["score"] and got["verdict"] == want["verdict"]
    assert line["response"]["headers"]["X-miLLM-Probe-Verdicts"] == sync.headers["x-millm-probe-verdicts"]
