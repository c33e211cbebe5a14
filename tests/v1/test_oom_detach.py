"""An out-of-memory error in a steered forward, as the web tier sees it (docs/engine.md,
"Out of memory"; docs/api.md, ``sae:detached``): the engine detaches every SAE and tells
the web tier on its ``on_event`` callback (``orchestration.engine_events.handle``, the one
the site installs), which forgets the registry rows (attachments gone, SAEs ``ready``
again, the attach lock released, an operator's own lock kept), clears every scope's live
steering on them and publishes ``sae:detached`` (reason ``out_of_memory``) — all before
the request that hit the OOM gets its ``insufficient_memory`` answer. The next request
without steering runs unsteered (the process's copy of the live steering was dropped)
instead of failing on an SAE the engine no longer holds.

The OOM is faked at the engine's boundary with the model (the forward the engine runs
raises ``torch.OutOfMemoryError`` once); everything else is the real server: the SAEs
attached and the live steering set through /api, the request sent to /v1."""

from __future__ import annotations

import pytest
import torch

from core import events
from gpu_engine.api.protocol import GenerationJob, SamplingParams
from registry.models import SAE, Attachment, Model
from steering.models import LiveSteering
from tests.published import recording
from tests.v1.conftest import KEYS
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "the sea and the sky"
PAIRS = (("tiny-llama-L1-relu", 1), ("tiny-llama-L3-relu", 3))


def _api(server, method: str, path: str, key: str, body=None):
    base = server.base_url[: -len("/v1")] + "/api"
    return request(base, method, path, body, headers={"Authorization": f"Bearer {key}"})


def _complete(server, key: str):
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return request(server.base_url, "POST", "/completions", body, headers={"Authorization": f"Bearer {key}"})


def _unsteered(server) -> str:
    """The engine's own answer without steering: what a request must get once the SAEs are
    gone (computed by the engine directly, not through the web tier)."""
    return server.engine.generate_sync(
        GenerationJob(
            request_id="ref-unsteered",
            prompt=PROMPT,
            sampling=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        ),
        timeout_s=60,
    ).text


def _oom_once(engine, monkeypatch) -> list[int]:
    """The next forward the engine runs raises CUDA's out-of-memory error (once)."""
    calls: list[int] = []
    sched = engine._scheduler
    owner, name = (sched.backend, "start") if sched is not None else (engine.backend, "generate")
    real = getattr(owner, name)

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (faked)")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, boom)
    return calls


def test_the_site_wires_engine_events_to_the_web_tier():
    """The engine the site builds reports to ``engine_events.handle`` (cut that wiring and
    an OOM detach would leave the rows and live steering behind)."""
    from core.runtime import runtime
    from orchestration.engine_events import handle

    client = runtime()._builders["engine"]()
    try:
        assert client.engine.on_event is handle
    finally:
        client.shutdown()


def test_an_oom_detach_forgets_rows_and_live_steering_before_the_answer(llama, keyed, monkeypatch):
    from orchestration.engine_events import handle

    server = llama
    root, alice = KEYS["root"], KEYS["alice"]
    # the engine reports to the web tier as the site wires it (the fixture's engine has no listener)
    monkeypatch.setattr(server.engine, "on_event", handle)
    saes = {name: SAE.objects.get(name=name) for name, _ in PAIRS}
    for name, layer in PAIRS:
        answer = _api(server, "POST", f"/saes/{saes[name].id}/attach", root, {"layer": layer})
        assert answer.status == 200, answer.body[:300]
    relu1, relu3 = saes["tiny-llama-L1-relu"], saes["tiny-llama-L3-relu"]
    # live steering in two scopes: the global one (admin) and alice's own
    body = {"sae_id": relu1.id, "steering": {"3": 12.0}}
    assert _api(server, "POST", "/saes/steering/batch", root, body).status == 200
    body = {"sae_id": relu3.id, "steering": {"40": 6.0}, "scope": "key:alice"}
    assert _api(server, "POST", "/saes/steering/batch", alice, body).status == 200
    model = Model.objects.get(name="tiny-llama")
    assert model.locked and Attachment.objects.filter(model=model).count() == 2
    assert LiveSteering.objects.filter(enabled=True).count() == 2
    expected = _unsteered(server)

    seen = recording(monkeypatch, events)
    calls = _oom_once(server.engine, monkeypatch)
    answer = _complete(server, alice)  # alice's scope steers it: the faked OOM hits it
    assert len(calls) == 1
    assert answer.status == 503, answer.body[:300]
    error = answer.json()["error"]
    assert error["code"] == "insufficient_memory", error
    assert int(answer.headers["retry-after"]) > 0

    # the rows were forgotten before that answer left
    assert Attachment.objects.count() == 0
    assert set(SAE.objects.filter(pk__in=[relu1.id, relu3.id]).values_list("status", flat=True)) == {SAE.Status.READY}
    model.refresh_from_db()
    assert model.locked is False
    assert LiveSteering.objects.count() == 0
    assert server.engine.attachments() == []
    detached = sorted((d["sae_id"], d["layer"], d["reason"]) for n, d in seen if n == "sae:detached")
    assert detached == sorted((saes[name].id, layer, "out_of_memory") for name, layer in PAIRS)
    # the browser hears each scope's live steering go (disabled, nothing left)
    updates = [d for n, d in seen if n == "steering:update"]
    assert sorted((u["sae_id"], u.get("scope", "global"), u["enabled"], u["values"]) for u in updates) == sorted(
        [(relu1.id, "global", False, {}), (relu3.id, "key:alice", False, {})]
    )

    # the API says the same: nothing attached, no live steering in either scope
    listed = _api(server, "GET", "/saes/attachments", root)
    assert listed.status == 200 and listed.json()["data"]["count"] == 0, listed.body[:300]
    # and the next requests without steering run unsteered, as the engine alone would
    for key in (alice, root):
        again = _complete(server, key)
        assert again.status == 200, again.body[:300]
        assert again.json()["choices"][0]["text"] == expected
        assert again.headers["x-millm-steering"].startswith("none"), again.headers


def test_an_oom_detach_keeps_the_operators_own_lock(llama, monkeypatch):
    from orchestration.engine_events import handle
    from tests.v1.conftest import attach

    server = llama
    monkeypatch.setattr(server.engine, "on_event", handle)
    attach("tiny-llama-L1-relu", 1)
    Model.objects.filter(name="tiny-llama").update(locked=True, locked_by_operator=True)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body["steering"] = {"features": [{"index": 3, "strength": 8}]}
    _oom_once(server.engine, monkeypatch)
    answer = request(server.base_url, "POST", "/completions", body)
    assert answer.status == 503 and answer.json()["error"]["code"] == "insufficient_memory", answer.body[:300]
    assert Attachment.objects.count() == 0
    model = Model.objects.get(name="tiny-llama")
    assert (model.locked, model.locked_by_operator) == (True, True)
    Model.objects.filter(pk=model.pk).update(locked=False, locked_by_operator=False)
