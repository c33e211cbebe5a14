"""Several engines, one front, as separate OS processes: two ``manage.py run_engine``
(``default`` and ``--name gpu1``), one ``manage.py serve`` and a Celery worker on their own
PostgreSQL and Redis databases, with ``ENGINE_MODELS=gpu1:tiny-gpt2;default:tiny-llama``.

Each engine holds its own model at the same time (loading one leaves the other's alone);
interleaved /v1 requests to both are answered by the engine that holds the model they
name — scores equal to the test's own forward pass of that model's weights, greedy texts
equal to the same request sent alone; ``/v1/models`` and ``/api/engines`` show both; an
unload on one engine leaves the other serving, and a request for the unloaded model loads it
again on its own engine, and a killed engine restarted under its name restores its own model
only. Bad input: an unknown model is 404 ``model_not_found``; a
registered model no engine may hold is 409 ``model_not_routable`` on /v1 and
``MODEL_NOT_ROUTABLE`` on the load route, with no job created."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import httpx2 as httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_engine.api.transport import Keys
from tests.distributed.conftest import PYTHON, REPO, Proc
from tests.distributed.test_processes import Cluster, cluster, wait_for  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

ROUTES = "gpu1:tiny-gpt2;default:tiny-llama"
ENGINE_OF = {"tiny-llama": "default", "tiny-gpt2": "gpu1"}
PROMPT_IDS = [5, 9, 14, 3, 22, 7]
ALLOWED = [5, 17, 42, 99]


def reference_scores(path: str, ids: list[int], allowed: list[int]) -> dict[str, float]:
    """The next token's log-probabilities over ``allowed`` only, from a plain forward of
    the model's weights (what /v1 scoring mode answers, computed here)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    picked = [float(logits[i]) for i in allowed]
    top = max(picked)
    lse = top + math.log(sum(math.exp(v - top) for v in picked))
    return {f"token_id:{i}": v - lse for i, v in zip(allowed, picked)}


def score_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT_IDS,
        "max_tokens": 1,
        "allowed_token_ids": ALLOWED,
        "logprobs": len(ALLOWED),
        "return_tokens_as_token_ids": True,
    }


def greedy_body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def heartbeat(c: Cluster, engine: str) -> dict[str, Any] | None:
    prefix = c.prefix if engine == "default" else f"{c.prefix}.{engine}"
    raw = c.redis.get(Keys(prefix).heartbeat)
    return json.loads(raw) if raw else None


def holds(c: Cluster, engine: str) -> str | None:
    hb = heartbeat(c, engine)
    status = (hb or {}).get("status") or {}
    return status.get("model_id") if status.get("state") == "ready" else None


def test_two_engines_serve_two_models(cluster: Cluster, procs: list[Proc], tiny_assets):
    c = cluster
    c.env["ENGINE_MODELS"] = ROUTES
    # no engine is killed here: a slow beat while two engines load on a shared machine
    # must not count as a death
    c.env["ENGINE_HEARTBEAT_S"] = "0.5"
    c.env["ENGINE_DEAD_AFTER_S"] = "30"
    manage = str(REPO / "manage.py")
    c.start("engine-default", [PYTHON, manage, "run_engine"])
    gpu1 = c.start("engine-gpu1", [PYTHON, manage, "run_engine", "--name", "gpu1"])
    c.start_web("web")
    c.start_worker()
    for engine in ("default", "gpu1"):
        wait_for(
            f"engine {engine}'s heartbeat",
            lambda e=engine: (heartbeat(c, e) or {}).get("phase") == "serving",
            120,
            procs,
        )
    assert heartbeat(c, "gpu1")["engine_name"] == "gpu1"
    wait_for("the web server", lambda: c.live("web"), 60, procs)

    models = c.api("web", "GET", "/api/models").json()["data"]["models"]
    ids = {m["name"]: m["id"] for m in models}

    # --- bad input first: nothing below may be half-done by it
    resp = c.api("web", "POST", "/v1/completions", json=greedy_body("no-such-model"))
    assert resp.status_code == 404, resp.text
    assert resp.json()["error"]["code"] == "model_not_found"
    resp = c.api("web", "POST", "/v1/completions", json=greedy_body("tiny-gemma2"))
    assert resp.status_code == 409, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_not_routable" and "tiny-gemma2" in error["message"]
    resp = c.api("web", "POST", f"/api/models/{ids['tiny-gemma2']}/load")
    assert resp.status_code == 409, resp.text
    assert resp.json()["error"]["code"] == "MODEL_NOT_ROUTABLE"
    jobs = c.api("web", "GET", "/api/jobs").json()["data"]["jobs"]
    assert not [j for j in jobs if j["target"] == "tiny-gemma2"], jobs
    gemma = c.api("web", "GET", f"/api/models/{ids['tiny-gemma2']}").json()["data"]
    assert (gemma["status"], gemma["engine"]) == ("ready", None)

    # --- each model loads on its own engine, the first staying where it is
    for name in ("tiny-llama", "tiny-gpt2"):
        resp = c.api("web", "POST", f"/api/models/{ids[name]}/load")
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["data"]["job"]["id"]
        wait_for(
            f"the load of {name}",
            lambda j=job_id: c.api("web", "GET", f"/api/jobs/{j}").json()["data"]["status"] == "succeeded",
            120,
            procs,
        )
    assert (holds(c, "default"), holds(c, "gpu1")) == ("tiny-llama", "tiny-gpt2")
    for name, engine in ENGINE_OF.items():
        row = c.api("web", "GET", f"/api/models/{ids[name]}").json()["data"]
        assert (row["status"], row["engine"]) == ("loaded", engine)
    listed = {m["id"] for m in c.api("web", "GET", "/v1/models").json()["data"]}
    assert {"tiny-llama", "tiny-gpt2"} <= listed
    engines = {e["name"]: e for e in c.api("web", "GET", "/api/engines").json()["data"]["engines"]}
    assert set(engines) == {"default", "gpu1"}
    for name, engine in ENGINE_OF.items():
        assert engines[engine]["alive"] and engines[engine]["model"] == name
        assert engines[engine]["recorded"] == [name]
    assert engines["gpu1"]["prefix"] == f"{c.prefix}.gpu1"
    # health, /api/models and /v1/capabilities answer for both engines
    resp = c.api("web", "GET", "/api/health/ready")
    assert resp.status_code == 200, resp.text
    ready = resp.json()["data"]
    assert {e["name"]: (e["ready"], e["model_name"]) for e in ready["engines"]} == {
        engine: (True, name) for name, engine in ENGINE_OF.items()
    }
    inference = c.api("web", "GET", "/api/health/inference").json()["data"]
    weights = {e["name"]: e["weights"].get("bytes") for e in inference["engines"]}
    assert weights["gpu1"] and weights["default"] and weights["gpu1"] != weights["default"]
    listed = c.api("web", "GET", "/api/models").json()["data"]
    assert listed["loaded_models"] == {engine: ids[name] for name, engine in ENGINE_OF.items()}
    caps = {e["id"]: e for e in c.api("web", "GET", "/v1/capabilities").json()["data"]}
    for name, engine in ENGINE_OF.items():
        assert (caps[name]["engine"], caps[name]["resident"]) == (engine, True)

    # --- references: each model's own weights, and each greedy answer sent alone
    want_scores = {
        name: reference_scores(str(tiny_assets.models[name].path), PROMPT_IDS, ALLOWED) for name in ENGINE_OF
    }
    alone = {}
    for name in ENGINE_OF:
        resp = c.api("web", "POST", "/v1/completions", json=greedy_body(name))
        assert resp.status_code == 200, resp.text
        alone[name] = resp.json()["choices"][0]["text"]
    assert alone["tiny-llama"] != alone["tiny-gpt2"]  # else the texts could not tell engines apart

    # --- interleaved: both models at once, alternating, started together
    order = [name for _ in range(3) for name in ("tiny-llama", "tiny-gpt2")]
    kinds = ["score", "greedy"] * 3
    requests = [(name, kind) for name in order for kind in kinds[:2]]
    results: list[httpx.Response | None] = [None] * len(requests)
    gate = threading.Barrier(len(requests))

    def send(i: int, name: str, kind: str) -> None:
        body = score_body(name) if kind == "score" else greedy_body(name)
        gate.wait(timeout=60)
        results[i] = httpx.post(f"{c.webs['web']}/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=send, args=(i, n, k)) for i, (n, k) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for (name, kind), resp in zip(requests, results):
        assert resp is not None and resp.status_code == 200, (name, kind, resp and resp.text)
        out = resp.json()
        assert out["model"] == name
        choice = out["choices"][0]
        if kind == "score":
            got = choice["logprobs"]["top_logprobs"][0]
            assert set(got) == set(want_scores[name]), got
            for key, value in want_scores[name].items():
                assert got[key] == pytest.approx(value, abs=1e-4), (name, key)
        else:
            assert choice["text"] == alone[name], name

    # --- an SAE attaches on the engine holding the model it was trained on; steering
    # a request for that model uses it there, and the detach goes back to that engine
    saes = {s["name"]: s["id"] for s in c.api("web", "GET", "/api/saes").json()["data"]["saes"]}
    sae_id = saes["tiny-gpt2-L1-relu"]
    resp = c.api("web", "POST", f"/api/saes/{sae_id}/attach", json={"layer": 1})
    assert resp.status_code == 200, resp.text
    attached = {e: [a["sae_id"] for a in heartbeat(c, e)["status"]["attachments"]] for e in ("default", "gpu1")}
    assert attached == {"default": [], "gpu1": [sae_id]}
    steer = {"steering": {"features": [{"index": 3, "strength": 8}]}}
    resp = c.api("web", "POST", "/v1/completions", json={**greedy_body("tiny-gpt2"), **steer})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-miLLM-Steering"] != "none"
    assert resp.json()["millm"]["steering_apply_count"][0]["count"] > 0
    assert resp.json()["choices"][0]["text"] != alone["tiny-gpt2"]
    resp = c.api("web", "POST", f"/api/saes/{sae_id}/detach", json={})
    assert resp.status_code == 200, resp.text
    assert heartbeat(c, "gpu1")["status"]["attachments"] == []

    # --- an unload on one engine leaves the other serving; a request loads it back there
    resp = c.api("web", "POST", f"/api/models/{ids['tiny-gpt2']}/unload")
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["data"]["job"]["id"]
    wait_for(
        "the unload of tiny-gpt2",
        lambda: c.api("web", "GET", f"/api/jobs/{job_id}").json()["data"]["status"] == "succeeded",
        60,
        procs,
    )
    assert (holds(c, "default"), holds(c, "gpu1")) == ("tiny-llama", None)
    row = c.api("web", "GET", f"/api/models/{ids['tiny-gpt2']}").json()["data"]
    assert (row["status"], row["engine"]) == ("ready", None)
    resp = c.api("web", "POST", "/v1/completions", json=greedy_body("tiny-llama"))
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == alone["tiny-llama"]
    # keys are off: /v1 loads on demand, on the model's engine, the other's model untouched
    resp = httpx.post(f"{c.webs['web']}/v1/completions", json=greedy_body("tiny-gpt2"), timeout=180)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == alone["tiny-gpt2"]
    assert (holds(c, "default"), holds(c, "gpu1")) == ("tiny-llama", "tiny-gpt2")
    row = c.api("web", "GET", f"/api/models/{ids['tiny-gpt2']}").json()["data"]
    assert (row["status"], row["engine"]) == ("loaded", "gpu1")

    # --- gpu1 dies and comes back: it restores its own recorded model, default keeps its own
    dead_id = heartbeat(c, "gpu1")["engine_id"]
    gpu1.kill9()
    c.start("engine-gpu1-again", [PYTHON, manage, "run_engine", "--name", "gpu1"])
    # the dead engine's last heartbeat lingers until it expires: wait for the new engine's
    wait_for(
        "gpu1 restored",
        lambda: (
            (hb := heartbeat(c, "gpu1") or {}).get("engine_id") not in (None, dead_id)
            and hb.get("phase") == "serving"
            and holds(c, "gpu1") == "tiny-gpt2"
        ),
        120,
        procs,
    )
    assert holds(c, "default") == "tiny-llama"
    for name in ENGINE_OF:
        resp = c.api("web", "POST", "/v1/completions", json=greedy_body(name))
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == alone[name], resp.text
