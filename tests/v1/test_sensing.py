"""Sensing on /v1 (docs/monitoring.md, "Sensing"): /api/monitoring/sensing arms clusters
and circuits; a /v1 generation publishes ``sensing:cluster`` on ``/ws/events`` for each
watched document whose members co-fire, at exactly the rows where they do; the tokens never
change.

The expected rows are the test's own: an independent float64 encode (``RefSAE``'s weights)
of a float32 reference forward of a second copy of the tiny model."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
from websockets.sync.client import connect

from tests.engine.helpers import RefSAE
from tests.v1.conftest import attach
from tests.v1.test_probes import PROMPT_IDS, SAE, api, completion, hf  # noqa: F401

MARGIN = 0.05  # members whose pre-activation is this close to 0 at a row are not chosen


def _reference(hf, server, tiny_assets):  # noqa: F811
    import base64

    from gpu_engine.artifacts import load_capture
    from tests.engine.test_capture import reference_blocks

    resp = completion(server, {"capture": {"layers": [0], "positions": "last"}})
    meta = load_capture(base64.b64decode(resp.json()["millm"]["capture"]["data"])).meta
    ids = meta["completion_token_ids"]
    rows = reference_blocks(*hf, PROMPT_IDS + ids[:-1])[1][len(PROMPT_IDS) - 1:]
    ref = RefSAE(tiny_assets.saes[SAE])
    x = np.asarray(rows, dtype=np.float64)
    if ref.apply_b_dec:
        x = x - ref.b_dec
    pre = x @ ref.W_enc + ref.b_enc
    assert ref.activation == "relu"
    return pre, resp.json()["choices"][0]["text"]


def _pairs(pre):
    """(co-firing pair, its rows) and a pair that never co-fires, among features whose
    pre-activation is clear of 0 at every row."""
    clear = np.where((np.abs(pre) > MARGIN).all(axis=0))[0]
    fires = {int(f): pre[:, f] > 0 for f in clear}
    some = [f for f, m in fires.items() if 0 < m.sum() < len(m)]
    co = never = None
    for a, b in itertools.combinations(some, 2):
        both = fires[a] & fires[b]
        if co is None and 0 < both.sum() < len(both):
            co = ((a, b), [int(i) for i in np.where(both)[0]])
        if never is None and not both.any():
            never = (a, b)
        if co and never:
            break
    assert co is not None and never is not None, "the tiny model has no such pair"
    return co, never


def _cluster(server, name, features):
    doc = {"kind": "mistudio.cluster-definition", "schema_version": "1", "name": name,
           "members": [{"feature_idx": f, "strength": 1.0} for f in features],
           "sae": {"n_features": 256, "layer": 1}}
    resp = api(server, "POST", "/api/clusters/import", doc)
    assert resp.status == 201, resp.body[:500]
    cluster = resp.json()["data"]["cluster"]
    assert cluster["id"]
    return cluster["id"]


def _sensing_events(ws, wait_s):
    out, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            raw = ws.recv(timeout=max(0.05, deadline - time.monotonic()))
        except TimeoutError:
            break
        message = json.loads(raw)
        if message["event"].startswith("sensing:"):
            out.append(message)
    return out


def test_armed_cluster_fires_at_the_rows_its_members_cofire(llama, hf, tiny_assets):  # noqa: F811
    sae = attach(SAE, 1)
    pre, plain_text = _reference(hf, llama, tiny_assets)
    (co, co_rows), never = _pairs(pre)
    cid = _cluster(llama, "cofire", co)
    quiet = _cluster(llama, "apart", never)
    n_prompt = len(PROMPT_IDS)

    armed = api(llama, "POST", "/api/monitoring/sensing", {"kind": "cluster", "id": cid})
    assert armed.status == 201, armed.body
    assert armed.json()["data"]["armed"] is True
    listed = api(llama, "GET", "/api/monitoring/sensing").json()["data"]
    assert [(a["kind"], a["id"]) for a in listed["armed"]] == [("cluster", cid)]
    (watched,) = listed["watched"]
    assert watched["watched_now"] is True and watched["source"] == "armed"
    assert [(m["sae_id"], m["layer"], m["feature"]) for m in watched["members"]] == [
        (sae.id, 1, f) for f in co]

    ws_url = llama.url.replace("http://", "ws://") + "/ws/events"
    with connect(ws_url, open_timeout=10) as ws:
        resp = completion(llama, {})
        got = resp.json()
        # observe, never gate: the same tokens, and nothing added to the response
        assert got["choices"][0]["text"] == plain_text
        assert "millm" not in got
        (event,) = _sensing_events(ws, 5.0)
        assert event["event"] == "sensing:cluster"
        data = event["data"]
        assert data["kind"] == "cluster" and data["id"] == cid and data["name"] == "cofire"
        assert data["request_id"] == got["id"] and data["choice"] == 0
        assert data["rows"] == [n_prompt - 1 + i for i in co_rows]
        assert data["token_indices"] == co_rows
        first = co_rows[0]
        for m, f in zip(data["members"], co):
            assert (m["layer"], m["feature"], m["sae_id"]) == (1, f, sae.id)
            assert m["activation"] == pytest.approx(pre[first, f], abs=5e-3)

        # the request's own read of the same attachment and read point never sees the
        # sensing records (one row per position, only the features it asked for), streamed
        # or not
        asked = {"features": [co[1]], "positions": "completion", "read_point": "pre_steering"}
        for stream in (False, True):
            resp = completion(llama, {"return_sae_activations": asked, "stream": stream})
            acts = (resp.events()[-2] if stream else resp.json())["millm"]["sae_activations"]
            assert [r["position"] for r in acts["positions"]] == [
                n_prompt - 1 + i for i in range(len(pre))]
            assert all([a["feature_index"] for a in r["features"]] == [co[1]]
                       for r in acts["positions"])
            assert len(_sensing_events(ws, 5.0)) == 1

        # members that never co-fire: no event
        assert api(llama, "DELETE", "/api/monitoring/sensing",
                   {"kind": "cluster", "id": cid}).status == 200
        assert api(llama, "POST", "/api/monitoring/sensing",
                   {"kind": "cluster", "id": "apart"}).status == 201
        assert completion(llama, {}).json()["choices"][0]["text"] == plain_text
        assert _sensing_events(ws, 2.0) == []

        # disarmed: no event either, though the members would co-fire
        assert api(llama, "DELETE", "/api/monitoring/sensing",
                   {"kind": "cluster", "id": quiet}).status == 200
        assert api(llama, "GET", "/api/monitoring/sensing").json()["data"]["armed"] == []
        completion(llama, {})
        assert _sensing_events(ws, 2.0) == []

        # the active cluster is watched without arming (read before its own steering)
        activated = api(llama, "POST", f"/api/clusters/{cid}/activate", {"intensity": 0})
        assert activated.status == 200, activated.body[:300]
        active = completion(llama, {}).json()
        (event,) = _sensing_events(ws, 5.0)
        assert event["data"]["source"] == "active" and event["data"]["request_id"] == active["id"]
        assert event["data"]["rows"] == [n_prompt - 1 + i for i in co_rows]
        api(llama, "POST", f"/api/clusters/{cid}/deactivate")


def test_refusals(llama):
    for body, status, code in (
            ({"kind": "cluster", "id": 987654}, 404, "CLUSTER_NOT_FOUND"),
            ({"kind": "circuit", "id": 987654}, 404, "CIRCUIT_NOT_FOUND"),
            ({"kind": "profile", "id": 1}, 422, "VALIDATION_ERROR"),
            ({"kind": "cluster"}, 422, "VALIDATION_ERROR")):
        resp = api(llama, "POST", "/api/monitoring/sensing", body)
        assert resp.status == status, resp.body
        assert resp.json()["error"]["code"] == code
    doc = {"kind": "mistudio.cluster-definition", "schema_version": "1", "name": "idle",
           "members": [{"feature_idx": 1, "strength": 1.0}], "sae": {"n_features": 256}}
    cid = api(llama, "POST", "/api/clusters/import", doc).json()["data"]["cluster"]["id"]
    resp = api(llama, "DELETE", f"/api/monitoring/sensing?kind=cluster&id={cid}")
    assert resp.status == 404 and resp.json()["error"]["code"] == "SENSING_NOT_ARMED"
    resp = api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "cluster", "id": 987654})
    assert resp.status == 404 and resp.json()["error"]["code"] == "CLUSTER_NOT_FOUND"
