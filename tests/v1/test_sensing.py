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


def _references(hf, server, tiny_assets, saes):  # noqa: F811
    """{layer: (completion rows, features)} float64 pre-activations of each (SAE, layer),
    and the plain completion's text."""
    import base64

    from gpu_engine.api.artifacts import load_capture
    from tests.engine.test_capture import reference_blocks

    resp = completion(server, {"capture": {"layers": [0], "positions": "last"}})
    meta = load_capture(base64.b64decode(resp.json()["millm"]["capture"]["data"])).meta
    ids = meta["completion_token_ids"]
    blocks = reference_blocks(*hf, PROMPT_IDS + ids[:-1])
    out = {}
    for name, layer in saes:
        ref = RefSAE(tiny_assets.saes[name])
        x = np.asarray(blocks[layer][len(PROMPT_IDS) - 1 :], dtype=np.float64)
        if ref.apply_b_dec:
            x = x - ref.b_dec
        assert ref.activation == "relu"
        out[layer] = x @ ref.W_enc + ref.b_enc
    return out, resp.json()["choices"][0]["text"]


def _reference(hf, server, tiny_assets):  # noqa: F811
    pre, text = _references(hf, server, tiny_assets, [(SAE, 1)])
    return pre[1], text


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
    doc = {
        "kind": "mistudio.cluster-definition",
        "schema_version": "1",
        "name": name,
        "members": [{"feature_idx": f, "strength": 1.0} for f in features],
        "sae": {"n_features": 256, "layer": 1},
    }
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
    assert [(m["sae_id"], m["layer"], m["feature"]) for m in watched["members"]] == [(sae.id, 1, f) for f in co]

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
            assert [r["position"] for r in acts["positions"]] == [n_prompt - 1 + i for i in range(len(pre))]
            assert all([a["feature_index"] for a in r["features"]] == [co[1]] for r in acts["positions"])
            assert len(_sensing_events(ws, 5.0)) == 1

        # members that never co-fire: no event
        assert api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "cluster", "id": cid}).status == 200
        assert api(llama, "POST", "/api/monitoring/sensing", {"kind": "cluster", "id": "apart"}).status == 201
        assert completion(llama, {}).json()["choices"][0]["text"] == plain_text
        assert _sensing_events(ws, 2.0) == []

        # disarmed: no event either, though the members would co-fire
        assert api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "cluster", "id": quiet}).status == 200
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


L3_SAE = "tiny-llama-L3-relu"


def _circuit_members(pre1, pre3):
    """A layer-1 and a layer-3 feature and a threshold for the layer-3 one, all clear of
    the rule's edges by MARGIN at every row, such that they co-fire at some rows but not
    all, and fewer than with threshold 0 (so the threshold shows); and a pair that never
    co-fires."""

    def clear(pre, threshold=0.0):
        return [int(f) for f in np.where((np.abs(pre - threshold) > MARGIN).all(axis=0))[0]]

    co = never = None
    for a in clear(pre1):
        fa = pre1[:, a] > 0
        if not 0 < fa.sum() < len(fa):
            continue
        for b in clear(pre3):
            fb = pre3[:, b] > 0
            if never is None and fb.any() and not (fa & fb).any():
                never = (a, b)
            if co is not None or (fa & fb).sum() < 2:
                continue
            # a threshold between two of b's values where both fire, clear of every row
            values = np.sort(pre3[fa & fb, b])
            for lo, hi in zip(values, values[1:]):
                t = float((lo + hi) / 2)
                if hi - lo > 2 * MARGIN and (np.abs(pre3[:, b] - t) > MARGIN).all():
                    rows = [int(i) for i in np.where(fa & (pre3[:, b] > t))[0]]
                    co = ((a, b), t, rows)
                    break
        if co and never:
            break
    assert co is not None and never is not None, "the tiny model has no such members"
    return co, never


def _circuit(server, name, sae1, sae3, members, threshold=None):
    """A two-layer circuit (layer 1 and layer 3 SAEs) of ``members`` = (feature at 1,
    feature at 3), the layer-3 member's ``threshold`` set when given."""
    f1, f3 = members
    second = {"feature_idx": f3, "strength": 1.0}
    if threshold is not None:
        second["threshold"] = threshold
    doc = {
        "kind": "mistudio.circuit-definition",
        "schema_version": "1",
        "name": name,
        "saes": [
            {"mistudio_sae_id": sae1.id, "layer": 1, "n_features": 256},
            {"mistudio_sae_id": sae3.id, "layer": 3, "n_features": 256},
        ],
        "members": [{"layer": 1, "feature": {"feature_idx": f1, "strength": 1.0}}, {"layer": 3, "feature": second}],
        "edges": [{"up": {"layer": 1, "feature_idx": f1}, "down": {"layer": 3, "feature_idx": f3}, "rung": 1}],
    }
    resp = api(server, "POST", "/api/circuits/import", doc)
    assert resp.status == 201, resp.body[:500]
    return resp.json()["data"]["id"]


def test_armed_circuit_fires_where_its_members_cofire_across_layers(llama, hf, tiny_assets):  # noqa: F811
    """A circuit's members sit at two layers (two SAEs): the event comes when the layer-1
    member is above 0 and the layer-3 member above its own threshold at the same row, and
    the rows are the test's own float64 encode's; members that never co-fire send none."""
    sae1, sae3 = attach(SAE, 1), attach(L3_SAE, 3)
    pre, plain_text = _references(hf, llama, tiny_assets, [(SAE, 1), (L3_SAE, 3)])
    ((f1, f3), threshold, co_rows), never = _circuit_members(pre[1], pre[3])
    assert co_rows != [int(i) for i in np.where((pre[1][:, f1] > 0) & (pre[3][:, f3] > 0))[0]]
    cid = _circuit(llama, "cofire-circuit", sae1, sae3, (f1, f3), threshold)
    quiet = _circuit(llama, "apart-circuit", sae1, sae3, never)
    n_prompt = len(PROMPT_IDS)
    armed = api(llama, "POST", "/api/monitoring/sensing", {"kind": "circuit", "id": cid})
    assert armed.status == 201, armed.body
    (watched,) = api(llama, "GET", "/api/monitoring/sensing").json()["data"]["watched"]
    assert watched["kind"] == "circuit" and watched["watched_now"] is True
    assert [(m["sae_id"], m["layer"], m["feature"], m["threshold"]) for m in watched["members"]] == [
        (sae1.id, 1, f1, 0.0),
        (sae3.id, 3, f3, pytest.approx(threshold)),
    ]

    ws_url = llama.url.replace("http://", "ws://") + "/ws/events"
    with connect(ws_url, open_timeout=10) as ws:
        got = completion(llama, {}).json()
        assert got["choices"][0]["text"] == plain_text and "millm" not in got  # never gates
        (event,) = _sensing_events(ws, 5.0)
        assert event["event"] == "sensing:circuit"
        data = event["data"]
        assert (data["kind"], data["id"], data["name"], data["source"]) == ("circuit", cid, "cofire-circuit", "armed")
        assert data["request_id"] == got["id"] and data["choice"] == 0
        assert data["rows"] == [n_prompt - 1 + i for i in co_rows]
        assert data["token_indices"] == co_rows
        first = co_rows[0]
        for m, (sae, layer, f) in zip(data["members"], ((sae1, 1, f1), (sae3, 3, f3))):
            assert (m["sae_id"], m["layer"], m["feature"]) == (sae.id, layer, f)
            assert m["activation"] == pytest.approx(pre[layer][first, f], abs=5e-3)

        # members that never co-fire: no event
        assert api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "circuit", "id": cid}).status == 200
        assert api(llama, "POST", "/api/monitoring/sensing", {"kind": "circuit", "id": quiet}).status == 201
        assert completion(llama, {}).json()["choices"][0]["text"] == plain_text
        assert _sensing_events(ws, 2.0) == []
        assert api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "circuit", "id": quiet}).status == 200


def test_refusals(llama):
    for body, status, code in (
        ({"kind": "cluster", "id": 987654}, 404, "CLUSTER_NOT_FOUND"),
        ({"kind": "circuit", "id": 987654}, 404, "CIRCUIT_NOT_FOUND"),
        ({"kind": "profile", "id": 1}, 422, "VALIDATION_ERROR"),
        ({"kind": "cluster"}, 422, "VALIDATION_ERROR"),
    ):
        resp = api(llama, "POST", "/api/monitoring/sensing", body)
        assert resp.status == status, resp.body
        assert resp.json()["error"]["code"] == code
    doc = {
        "kind": "mistudio.cluster-definition",
        "schema_version": "1",
        "name": "idle",
        "members": [{"feature_idx": 1, "strength": 1.0}],
        "sae": {"n_features": 256},
    }
    cid = api(llama, "POST", "/api/clusters/import", doc).json()["data"]["cluster"]["id"]
    resp = api(llama, "DELETE", f"/api/monitoring/sensing?kind=cluster&id={cid}")
    assert resp.status == 404 and resp.json()["error"]["code"] == "SENSING_NOT_ARMED"
    resp = api(llama, "DELETE", "/api/monitoring/sensing", {"kind": "cluster", "id": 987654})
    assert resp.status == 404 and resp.json()["error"]["code"] == "CLUSTER_NOT_FOUND"
