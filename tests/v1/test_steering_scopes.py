"""Live steering scopes (issue 37, part 2; docs/steering.md, Scopes), keys on, against the
real server: each inference key's own live steering runs on its own /v1 requests without
steering (compared with the engine run directly on the spec, and with the same request
with that steering inline), a key with no scope of its own runs the global one, the
X-miLLM-Steering header names the scope, an inference key cannot touch the global scope or
another key's (403, nothing changed) while an admin key can, and a Batch API line runs
its key's scope as it was when the batch was created."""

from __future__ import annotations

import json

import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams, SteeringEntry, SteeringSpec
from steering.models import LiveSteering
from tests.v1.conftest import KEYS, attach
from tests.v1.helpers import request

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "the sea and the sky"
CAROL = "sk-carol-0123456789"
ALICE_SET, BOB_SET, GLOBAL_SET = {"3": 12.0}, {"40": -6.5}, {"7": 9.0}


def _direct(server, steering=None):
    """The engine run directly on a spec: what the answer must be, independent of the code
    under test."""
    return server.engine.generate_sync(
        GenerationJob(
            request_id="ref",
            prompt=PROMPT,
            steering=steering,
            sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        ),
        timeout_s=60,
    )


def _complete(server, key: str, **extra):
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}
    return request(server.base_url, "POST", "/completions", body, headers={"Authorization": f"Bearer {key}"})


def _api(server, method: str, path: str, key: str, body=None):
    base = server.base_url[: -len("/v1")] + "/api"
    return request(base, method, path, body, headers={"Authorization": f"Bearer {key}"})


def _spec(sae_id: str, values: dict[str, float]) -> SteeringSpec:
    return SteeringSpec([SteeringEntry(sae_id, 1, {int(k): v for k, v in values.items()})])


def _rows() -> list[tuple]:
    return sorted(LiveSteering.objects.values_list("attachment_id", "scope", "enabled", "values", "controls"))


@pytest.fixture
def scoped(llama, keyed, settings):
    """tiny-llama with its relu SAE at layer 1; keys on with a third inference key, carol."""
    settings.MILLM_API_KEYS = [*settings.MILLM_API_KEYS, f"carol:{CAROL}"]
    return llama, attach("tiny-llama-L1-relu", 1)


def _set(server, key: str, sae_id: str, values: dict[str, float], scope: str | None):
    body = {"sae_id": sae_id, "steering": values, **({"scope": scope} if scope else {})}
    return _api(server, "POST", "/saes/steering/batch", key, body)


def test_each_key_runs_its_own_scope_and_a_key_without_one_runs_global(scoped):
    server, sae = scoped
    alice, bob, root = KEYS["alice"], KEYS["bob"], KEYS["root"]
    answer = _set(server, alice, sae.id, ALICE_SET, "key:alice")
    assert answer.status == 200, answer.body[:300]
    state = answer.json()["data"]
    assert (state["scope"], state["enabled"], state["values"]) == ("key:alice", True, ALICE_SET)
    assert _set(server, bob, sae.id, BOB_SET, "key:bob").status == 200
    answer = _set(server, root, sae.id, GLOBAL_SET, None)  # an admin key's default: global
    assert answer.status == 200 and "scope" not in answer.json()["data"]
    plain = _direct(server)
    for key, label, values in (
        (alice, "key:alice", ALICE_SET),
        (bob, "key:bob", BOB_SET),
        (CAROL, "global", GLOBAL_SET),
    ):
        spec = _spec(sae.id, values)
        reference = _direct(server, steering=spec)
        assert reference.text != plain.text  # positive control: the steer changes the output
        live = _complete(server, key)
        assert live.status == 200, live.body[:300]
        inline = _complete(
            server, key, steering={"features": [{"index": int(k), "strength": v} for k, v in values.items()]}
        )
        assert live.json()["choices"][0]["text"] == inline.json()["choices"][0]["text"] == reference.text
        assert live.json()["usage"]["completion_tokens"] == len(reference.token_ids)
        assert live.headers["x-millm-steering"] == (
            f'live;sae={sae.id};layer=1;features=1;scope={label};hash="{spec.canonical_hash()}"'
        )
    # a request's own steering still wins over its scope
    assert _complete(server, alice, steering={"features": []}).json()["choices"][0]["text"] == plain.text
    # clearing alice's scope: her requests fall back to the global one
    assert _api(server, "DELETE", f"/saes/steering?scope=key:alice&sae_id={sae.id}", alice).status == 200
    fallback = _complete(server, alice)
    assert fallback.json()["choices"][0]["text"] == _direct(server, steering=_spec(sae.id, GLOBAL_SET)).text
    assert ";scope=global;" in fallback.headers["x-millm-steering"]


def test_an_inference_key_cannot_touch_global_or_another_keys_scope(scoped):
    server, sae = scoped
    alice, bob, root = KEYS["alice"], KEYS["bob"], KEYS["root"]
    assert _set(server, bob, sae.id, BOB_SET, "key:bob").status == 200
    assert _set(server, root, sae.id, GLOBAL_SET, "global").status == 200
    before = _rows()
    attempts = [
        ("POST", "/saes/steering/batch", {"sae_id": sae.id, "steering": ALICE_SET}),  # default: global
        ("POST", "/saes/steering/batch", {"sae_id": sae.id, "steering": ALICE_SET, "scope": "global"}),
        ("POST", "/saes/steering/batch", {"sae_id": sae.id, "steering": ALICE_SET, "scope": "key:bob"}),
        ("POST", "/saes/steering", {"sae_id": sae.id, "feature_idx": 3, "value": 1.0, "scope": "key:bob"}),
        ("GET", "/saes/steering", None),
        ("GET", "/saes/steering?scope=global", None),
        ("GET", "/saes/steering?scope=key:bob", None),
        ("DELETE", "/saes/steering", None),
        ("DELETE", "/saes/steering?scope=key:bob", None),
        ("DELETE", "/saes/steering/40?scope=key:bob", None),
        ("POST", "/saes/steering/disable", {"scope": "global"}),
        ("POST", "/saes/steering/enable", {"scope": "key:bob"}),
    ]
    for method, path, body in attempts:
        answer = _api(server, method, path, alice, body)
        assert answer.status == 403, (method, path, answer.body[:300])
        error = answer.json()["error"]
        assert error["code"] == "FORBIDDEN" and "MILLM_ADMIN_API_KEYS" in error["message"], error
        assert KEYS["alice"] not in error["message"]
    assert _rows() == before  # nothing changed
    # a scope that is no scope is a validation error, for anyone
    assert _api(server, "GET", "/saes/steering?scope=bob", root).status == 422
    # alice reads her own (empty) scope; the admin reads and clears any
    own = _api(server, "GET", f"/saes/steering?scope=key:alice&sae_id={sae.id}", alice).json()["data"]
    assert (own["scope"], own["enabled"], own["values"]) == ("key:alice", False, {})
    seen = _api(server, "GET", f"/saes/steering?scope=key:bob&sae_id={sae.id}", root).json()["data"]
    assert (seen["scope"], seen["values"]) == ("key:bob", BOB_SET)
    assert _api(server, "GET", f"/saes/steering?sae_id={sae.id}", root).json()["data"]["values"] == GLOBAL_SET
    cleared = _api(server, "DELETE", f"/saes/steering?scope=key:bob&sae_id={sae.id}", root)
    assert cleared.status == 200 and cleared.json()["data"]["enabled"] is False
    assert (
        _complete(server, bob)
        .headers["x-millm-steering"]
        .startswith(f"live;sae={sae.id};layer=1;features=1;scope=global;")
    )


def test_a_batch_line_runs_its_keys_scope_as_of_creation(scoped, monkeypatch):
    from batches import services
    from batches.models import Batch
    from batches.runner import batch_run
    from batches.selectors import file_content
    from core.auth import ANONYMOUS, Principal
    from registry.models import Attachment
    from steering.services import live_set

    server, sae = scoped
    attachment = Attachment.objects.get(sae_id=sae.id, layer=1)
    live_set(attachment=attachment, values={7: 9.0})  # global
    live_set(attachment=attachment, values={3: 12.0}, scope="key:alice")
    monkeypatch.setattr(services, "enqueue", lambda *a, **k: None)  # this test runs them
    rows = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
        }
        for name in ("live", "other")
    ]
    rows[1]["body"]["steering"] = {"features": [{"index": 40, "strength": -6.5}]}  # what it names wins
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    batches = {}
    for label in ("alice", "bob"):
        who = Principal(owner=f"key:{label}", label=label, admin=False)
        file = services.file_create(filename="in.jsonl", purpose="batch", content=content, owner=who.owner)
        batches[label] = services.batch_create(
            input_file_id=file.id, endpoint="/v1/completions", completion_window="24h", principal=who
        )
    stored = Batch.objects.get(id=batches["alice"].id).live_steering
    assert stored == {
        "scope": "key:alice",
        "entries": [{"sae_id": sae.id, "layer": 1, "values": {"3": 12.0}, "controls": []}],
    }
    # alice's scope changes after creation: her batch still runs what it held then
    live_set(attachment=attachment, values={3: -20.0, 5: 4.0}, scope="key:alice")
    expected = {
        # bob has no scope of his own: his lines run unsteered, never the global steering
        "alice": (_spec(sae.id, {"3": 12.0}), f"live;sae={sae.id};layer=1;features=1;scope=key:alice;"),
        "bob": (None, "none"),
    }
    inline = _spec(sae.id, {"40": -6.5})
    for label, batch in batches.items():
        assert batch_run(batch_id=batch.id) == "completed"
        done = Batch.objects.get(id=batch.id)
        out = {
            x["custom_id"]: x["response"]
            for x in map(
                json.loads,
                b"".join(file_content(file_id=done.output_file_id, principal=ANONYMOUS)).splitlines(),
            )
        }
        spec, header = expected[label]
        assert out["live"]["body"]["choices"][0]["text"] == _direct(server, steering=spec).text, label
        assert out["live"]["headers"]["X-miLLM-Steering"].startswith(header), out["live"]["headers"]
        assert out["other"]["body"]["choices"][0]["text"] == _direct(server, steering=inline).text
    assert _direct(server, steering=_spec(sae.id, {"3": 12.0})).text != _direct(server).text


def test_a_keys_scope_events_name_their_owner_and_global_ones_do_not(scoped, monkeypatch):
    """``steering:update`` for a key's scope carries the owner field (/ws/events then sends
    it only to that key's sockets and admin keys); the global scope's event is as before."""
    from core import events
    from registry.models import Attachment
    from steering.services import live_clear, live_set

    server, sae = scoped
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(events, "publish", lambda event, data: sent.append((event, data)))
    attachment = Attachment.objects.get(sae_id=sae.id, layer=1)
    live_set(attachment=attachment, values={3: 12.0}, scope="key:alice")
    live_set(attachment=attachment, values={7: 9.0})
    live_clear(attachment=attachment, scope="key:alice")
    assert [(e, d.get(events.OWNER_FIELD), d.get("scope"), d["reason"]) for e, d in sent] == [
        ("steering:update", "key:alice", "key:alice", "set"),
        ("steering:update", None, None, "set"),
        ("steering:update", "key:alice", "key:alice", "clear"),
    ]
    assert set(sent[1][1]) == {"sae_id", "layer", "enabled", "values", "controls", "active_count", "source", "reason"}


def test_a_keys_scope_set_elsewhere_reaches_this_process_copy(scoped, settings):
    """Distributed: a key's scope written by another web worker (the row alone, nothing
    invalidated here) reaches this process's copy through the background refresher, so the
    request-time pick stays a lookup in memory."""
    import time

    from core.process_copy import refresher
    from registry.models import Attachment
    from steering.live import live_copy

    server, sae = scoped
    settings.EMBEDDED = False
    settings.MILLM_PROCESS_COPY_REFRESH = True
    live_copy.read()
    assert live_copy.fresh().keys == {}
    LiveSteering.objects.create(
        attachment=Attachment.objects.get(sae_id=sae.id, layer=1), scope="key:bob", enabled=True, values={"40": -6.5}
    )
    deadline = time.monotonic() + live_copy.fresh_s + 2
    seen = None
    while time.monotonic() < deadline:
        seen = live_copy.fresh()
        assert seen is not None
        if seen.keys:
            break
        time.sleep(0.05)
    settings.MILLM_PROCESS_COPY_REFRESH = False
    assert refresher.join(5)
    settings.EMBEDDED = True
    assert seen == [] and list(seen.keys) == ["key:bob"]
    assert seen.pick("key:bob")[0] == "key:bob" and seen.pick("key:bob")[1][0].features == {40: -6.5}
    assert seen.pick("key:alice")[0] == "global"
