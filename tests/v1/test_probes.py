"""Probes on /v1 (docs/monitoring.md, "Probes"): /api/probes, per-request ``probes`` and
the armed set, verdicts in ``X-miLLM-Probe-Verdicts``, ``millm.probes`` (inline and in
the stream's last chunk) and the probe history; refusals that create nothing and run no
forward.

Every expected score is computed here: an independent float64 encode (``RefSAE``) of a
float32 reference forward of a second copy of the tiny model, and the test's own numpy
dot product."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import RefSAE, count_forwards
from tests.engine.test_capture import reference_blocks
from tests.engine.tolerances import PROBE_ATOL
from tests.v1.conftest import attach
from tests.v1.helpers import assert_openai_error, request

PROMPT_IDS = [5, 17, 23, 42, 8, 11, 60, 3, 29, 14]
SAE = "tiny-llama-L1-relu"


@pytest.fixture(scope="module")
def hf(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    model = AutoModelForCausalLM.from_pretrained(str(asset.path), dtype=torch.float32, local_files_only=True).eval()
    return asset, model


def api(server, method, path, body=None, **kw):
    return request(server.url, method, path, body, **kw)


def parse_verdicts(header: str) -> dict[str, dict]:
    """An RFC 8941 list of string items with parameters, parsed by the test itself."""
    out = {}
    for item in re.findall(r'"((?:[^"\\]|\\.)*)"((?:;[a-z*][a-z0-9_.*-]*(?:=[^;,]+)?)*)', header):
        name, params = item
        values = {}
        for p in params.split(";")[1:]:
            key, _, value = p.partition("=")
            if not value:
                values[key] = True
            elif value in ("?1", "?0"):
                values[key] = value == "?1"
            elif value.startswith('"'):
                values[key] = value.strip('"')
            else:
                values[key] = float(value)
        out[name] = values
    return out


def completion(server, body):
    resp = request(
        server.base_url,
        "POST",
        "/completions",
        {"model": "tiny-llama", "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **body},
    )
    assert resp.status == 200, resp.body[:500]
    return resp


def reference_rows(hf, server, layer: int) -> tuple[np.ndarray, list[int]]:
    """Block ``layer``'s output at the completion rows (P-1 .. P+n-2) of the greedy run,
    from the test's own forward; the completion ids from a capture's sidecar."""
    import base64

    from gpu_engine.api.artifacts import load_capture

    resp = completion(server, {"capture": {"layers": [0], "positions": "last"}})
    meta = load_capture(base64.b64decode(resp.json()["millm"]["capture"]["data"])).meta
    ids = meta["completion_token_ids"]
    ref = reference_blocks(*hf, PROMPT_IDS + ids[:-1])
    return ref[layer][len(PROMPT_IDS) - 1 :], ids


def test_sae_probe_scores_exactly_inline_and_streamed(llama, hf, tiny_assets):
    sae = attach(SAE, 1)
    rows, ids = reference_rows(hf, llama, 1)
    acts = RefSAE(tiny_assets.saes[SAE]).encode(rows)  # float64, (rows, d_sae)
    features = [int(i) for i in np.argsort(-acts[-1])[:3]] + [int(np.argmin(acts[-1]))]
    rng = np.random.default_rng(3)
    weights = rng.uniform(-1, 1, size=len(features))
    mean, std = rng.normal(size=4) * 0.1, rng.uniform(0.5, 2, size=4)
    per_row = ((acts[:, features] - mean) / std) @ weights + 0.25
    last, avg = float(per_row[-1]), float(per_row.mean())
    assert abs(last) > 1e-3  # the probe reads something
    body = {
        "sae_id": sae.id,
        "layer": 1,
        "features": features,
        "weights": weights.tolist(),
        "bias": 0.25,
        "norm_mean": mean.tolist(),
        "norm_std": std.tolist(),
    }
    fires = api(llama, "POST", "/api/probes", {**body, "name": "fires", "threshold": last - 0.05})
    assert fires.status == 201, fires.body
    quiet = api(llama, "POST", "/api/probes", {**body, "name": "quiet", "threshold": avg + 0.05, "positions": "mean"})
    probe_id = fires.json()["data"]["id"]
    assert fires.json()["data"]["validated"] is False
    for name in ("fires", "quiet"):
        assert api(llama, "POST", f"/api/probes/{name}/validate").status == 200

    resp = completion(llama, {"probes": ["fires", {"name": "quiet"}]})
    got = resp.json()
    verdicts = {v["name"]: v for v in got["millm"]["probes"]}
    assert verdicts["fires"]["score"] == pytest.approx(last, abs=PROBE_ATOL)
    assert verdicts["fires"]["verdict"] is True and verdicts["fires"]["rows"] == len(ids)
    assert verdicts["quiet"]["score"] == pytest.approx(avg, abs=PROBE_ATOL)
    assert verdicts["quiet"]["verdict"] is False and verdicts["quiet"]["positions"] == "mean"
    header = parse_verdicts(resp.headers["x-millm-probe-verdicts"])
    assert header["fires"]["verdict"] is True and header["quiet"]["verdict"] is False
    assert header["fires"]["score"] == pytest.approx(last, abs=PROBE_ATOL + 5e-4)
    # a probe changes no token
    plain = completion(llama, {}).json()
    assert plain["choices"][0]["text"] == got["choices"][0]["text"]
    assert "millm" not in plain or "probes" not in plain["millm"]
    # the history has them, under the response id
    hist = api(llama, "GET", f"/api/monitoring/history?request_id={got['id']}").json()["data"]
    assert {v["name"]: v["verdict"] for v in hist["probe_verdicts"]} == {"fires": True, "quiet": False}
    assert hist["probe_verdicts"][0]["probe_id"] in (probe_id, quiet.json()["data"]["id"])

    stream = completion(llama, {"probes": [{"name": probe_id, "positions": "max"}], "stream": True})
    events = stream.events()
    assert events[-1] == "[DONE]"
    (v,) = events[-2]["millm"]["probes"]
    assert v["score"] == pytest.approx(float(per_row.max()), abs=PROBE_ATOL)
    assert "x-millm-probe-verdicts" not in stream.headers


def test_hidden_state_probe_scores_exactly(llama, hf):
    rows, _ = reference_rows(hf, llama, 2)
    rng = np.random.default_rng(5)
    w = rng.normal(size=rows.shape[1]) * 0.1
    want = float((rows @ w + 0.5).mean())
    buf = io.BytesIO()
    np.savez(buf, weights=w, bias=np.array(0.5), layer=np.array(2), threshold=np.array(want + 1))
    files = {"file": ("hidden.npz", buf.getvalue())}
    resp = _multipart(llama, "/api/probes/import", files, {"positions": "mean"})
    assert resp.status == 201, resp.body
    assert resp.json()["data"]["basis"] == "hidden_states"
    assert api(llama, "POST", "/api/probes/hidden/validate").status == 200
    got = completion(llama, {"probes": ["hidden"]})
    (v,) = got.json()["millm"]["probes"]
    assert v["score"] == pytest.approx(want, abs=PROBE_ATOL) and v["verdict"] is False
    assert "capture" not in got.json()["millm"]  # the probe's capture is not sent
    assert parse_verdicts(got.headers["x-millm-probe-verdicts"])["hidden"]["verdict"] is False


def _multipart(server, path, files, fields):
    boundary = "probeboundary7"
    parts = []
    for key, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode())
    for key, (name, data) in files.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"; '
            f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
            + data
            + b"\r\n"
        )
    raw = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return request(
        server.url, "POST", path, raw=raw, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )


def test_global_arming_applies_to_requests_without_their_own(llama, hf, tiny_assets):
    from monitoring.models import ProbeVerdict

    sae = attach(SAE, 1)
    body = {"sae_id": sae.id, "layer": 1, "features": [1, 2], "weights": [0.5, -0.5]}
    assert api(llama, "POST", "/api/probes", {**body, "name": "armed"}).status == 201
    assert api(llama, "POST", "/api/probes", {**body, "name": "own"}).status == 201
    refused = api(llama, "POST", "/api/probes/armed/arm")
    assert refused.status == 409 and refused.json()["error"]["code"] == "UNVALIDATED_PROBE"
    for name in ("armed", "own"):
        api(llama, "POST", f"/api/probes/{name}/validate")
    assert api(llama, "POST", "/api/probes/armed/arm").json()["data"]["armed"] is True

    plain = completion(llama, {})
    assert list(parse_verdicts(plain.headers["x-millm-probe-verdicts"])) == ["armed"]
    assert [v["name"] for v in plain.json()["millm"]["probes"]] == ["armed"]
    own = completion(llama, {"probes": ["own"]})
    assert list(parse_verdicts(own.headers["x-millm-probe-verdicts"])) == ["own"]
    none = completion(llama, {"probes": []})
    assert "x-millm-probe-verdicts" not in none.headers
    assert ProbeVerdict.objects.filter(name="armed").count() == 1

    # another model's probe: armed but not validated for it, reported as not scored
    from monitoring.models import Probe

    Probe.objects.filter(name="armed").update(validation={"model": "other"})
    from monitoring.probes import armed_copy

    armed_copy.invalidate()
    skipped = completion(llama, {})
    assert parse_verdicts(skipped.headers["x-millm-probe-verdicts"])["armed"] == {
        "not-scored": True,
        "reason": "unvalidated",
    }
    assert api(llama, "POST", "/api/probes/armed/disarm").json()["data"]["armed"] is False
    assert "x-millm-probe-verdicts" not in completion(llama, {}).headers


def test_refusals_create_nothing_and_run_no_forward(llama, openai_client):
    from monitoring.models import Probe, ProbeVerdict

    sae = attach(SAE, 1)
    good = {"name": "p", "sae_id": sae.id, "layer": 1, "features": [1], "weights": [1.0]}
    bad_bodies = [
        ({**good, "weights": [1.0, 2.0]}, 400, "PROBE_INVALID"),  # lengths disagree
        ({**good, "weights": ["x"]}, 400, "PROBE_INVALID"),
        ({**good, "basis": "elsewhere"}, 400, "PROBE_INVALID"),
        ({**good, "norm_std": [0.0], "norm_mean": [0.0]}, 400, "PROBE_INVALID"),
        ({**good, "extra": 1}, 400, "PROBE_INVALID"),
    ]
    for body, status, code in bad_bodies:
        resp = api(llama, "POST", "/api/probes", body)
        assert resp.status == status and resp.json()["error"]["code"] == code, resp.body
        assert "Traceback" not in resp.body.decode()
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    buf = io.BytesIO()
    import zipfile

    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("weights.npy", pickled.getvalue())
        z.writestr("layer.npy", _npy(np.array(1)))
    for name, data in (
        ("p.npz", buf.getvalue()),
        ("p.npz", b"not a zip"),
        ("p.json", b"{not json"),
        ("p.json", b"[1, 2]"),
        ("p.pkl", b"x"),
    ):
        resp = _multipart(llama, "/api/probes/import", {"file": (name, data)}, {})
        assert resp.status == 400, (name, resp.body)
        assert resp.json()["error"]["code"] == "PROBE_INVALID"
    assert not Probe.objects.exists()

    # dims that do not fit the resident model: refused by validation, which names them
    api(llama, "POST", "/api/probes", {**good, "features": [10_000]})
    mismatch = api(llama, "POST", "/api/probes/p/validate")
    assert mismatch.status == 409 and mismatch.json()["error"]["code"] == "PROBE_MODEL_MISMATCH"
    assert [m["field"] for m in mismatch.json()["error"]["details"]["mismatches"]] == ["d_sae"]
    assert api(llama, "POST", "/api/probes", {"name": "h", "layer": 1, "weights": [1.0] * 3}).status == 201
    mismatch = api(llama, "POST", "/api/probes/h/validate").json()["error"]
    assert mismatch["details"]["mismatches"][0]["field"] == "d_model"
    assert api(llama, "GET", "/api/probes/nope").json()["error"]["code"] == "PROBE_NOT_FOUND"
    assert api(llama, "DELETE", "/api/probes/nope").status == 404

    base = {"model": "tiny-llama", "prompt": "the sea", "max_tokens": 3}
    with count_forwards(llama.engine.backend.model) as forwards:
        assert_openai_error(
            request(llama.base_url, "POST", "/completions", {**base, "probes": ["nope"]}), 404, "probe_not_found"
        )
        assert_openai_error(
            request(llama.base_url, "POST", "/completions", {**base, "probes": ["p"]}), 409, "unvalidated_probe"
        )
        assert_openai_error(
            request(llama.base_url, "POST", "/completions", {**base, "probes": ["p", "p"]}),
            400,
            "invalid_probe_score_request",
        )
        assert (
            request(
                llama.base_url, "POST", "/completions", {**base, "probes": [{"name": "p", "positions": "first"}]}
            ).status
            == 400
        )
    assert forwards[0] == 0
    assert not ProbeVerdict.objects.exists()


def _npy(arr) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()
