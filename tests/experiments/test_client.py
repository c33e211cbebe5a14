"""The Python client's experiment calls (integrations/millm_client.py) against the live
daphne of tests/v1: what each returns equals what the routes answer over raw HTTP, the
downloads are the run's points in each format, and a refusal is a ``MillmError`` with the
route's code. The figures themselves are checked against the tests' own float64 forward
in test_sweep.py, test_fidelity.py and test_attribution_api.py; here the client must hand
them over unchanged."""

from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest

from integrations.millm_client import MillmClient, MillmError
from tests.experiments.conftest import api, ok

PROMPTS = ["the quick brown fox", {"messages": [{"role": "user", "content": "tell me about the sea"}]}]
FEATURE = 5


@pytest.fixture
def client(llama):
    return MillmClient(llama.base_url)  # the /v1 base: the client finds /api beside it


def test_a_sweep_through_the_client_equals_the_routes_and_its_downloads(sae, llama, client, tmp_path):
    run = client.sweep(
        prompts=PROMPTS, variants=[{"sae_id": sae.id, "index": FEATURE}], strengths=[0.0, 6.0], max_tokens=4
    )
    assert run["kind"] == "sweep" and run["total"] == 2 * (1 + 2) and run["id"].startswith("exp_")
    done = client.wait_experiment(run["id"], timeout_s=300, poll_s=0.1)
    assert done["status"] == "completed" and done["done"] == 6, done
    assert done == ok(api(llama, "GET", f"/api/experiments/{run['id']}"))

    points = ok(api(llama, "GET", f"/api/experiments/{run['id']}/points"))["points"]
    rows = client.download_experiment(run["id"])  # jsonl, parsed
    assert [r["ordinal"] for r in rows] == [p["ordinal"] for p in points] == list(range(6))
    for row, point in zip(rows, points, strict=True):
        assert row["run_id"] == run["id"]
        for key in ("text", "token_ids", "kl_mean", "kl_per_position", "strength", "is_default", "loglik"):
            assert row[key] == point[key], key

    text = client.download_experiment(run["id"], "csv")
    table = list(csv.DictReader(io.StringIO(text)))
    assert [int(r["ordinal"]) for r in table] == list(range(6))
    assert [json.loads(r["token_ids"]) for r in table] == [p["token_ids"] for p in points]

    parquet = client.download_experiment(run["id"], "parquet")
    frame = pq.read_table(io.BytesIO(parquet)).to_pylist()
    assert [r["text"] for r in frame] == [p["text"] for p in points]
    assert [r["kl_mean"] for r in frame] == [p["kl_mean"] for p in points]
    # written to a file as downloaded
    path = client.download_experiment(run["id"], "parquet", path=tmp_path / "sweep.parquet")
    assert path.read_bytes() == parquet
    with pytest.raises(ValueError):
        client.download_experiment(run["id"], "xlsx")


def test_calibrate_and_fidelity_start_runs_the_routes_answer(sae, llama, client):
    cal = client.calibrate(
        prompts=PROMPTS[:1],
        variant={"sae_id": sae.id, "index": FEATURE},
        target_kl=0.05,
        bounds=[0.0, 20.0],
        max_iterations=4,
        max_tokens=4,
    )
    assert cal["kind"] == "calibration"
    cal_done = client.wait_experiment(cal["id"], timeout_s=300, poll_s=0.1)
    assert cal_done["status"] == "completed", cal_done
    assert cal_done["result"] == ok(api(llama, "GET", f"/api/experiments/{cal['id']}"))["result"]
    assert "strength" in cal_done["result"]

    fid = client.fidelity(sae_id=sae.id, token_budget=128, context_tokens=32)
    assert fid["kind"] == "fidelity"
    fid_done = client.wait_experiment(fid["id"], timeout_s=300, poll_s=0.1)
    assert fid_done["status"] == "completed", fid_done
    assert fid_done == ok(api(llama, "GET", f"/api/experiments/{fid['id']}"))


def test_attribution_through_the_client_equals_the_route(sae, llama, client):
    body = {"sae_id": sae.id, "prompt": "the quick brown fox jumps", "top_n": 4, "ablate_top": 2}
    got = client.attribution(sae.id, prompt=body["prompt"], top_n=4, ablate_top=2)
    want = ok(api(llama, "POST", "/api/experiments/attribution", body))
    assert got == want and got["features"] and got["tokens"]
    chat = client.attribution(sae.id, messages=[{"role": "user", "content": "hi there"}], top_n=2, ablate_top=0)
    assert chat["target"]["greedy"] is True and len(chat["features"]) <= 2
    with pytest.raises(ValueError):
        client.attribution(sae.id)


def test_refusals_are_millm_errors_with_the_routes_codes(sae, llama, client):
    with pytest.raises(MillmError) as exc:
        client.experiment("exp_0000000000000000")
    assert exc.value.code == "EXPERIMENT_NOT_FOUND"
    with pytest.raises(MillmError) as exc:
        client.attribution("sae_0000000000000000", prompt="hi")
    assert exc.value.code == "SAE_NOT_FOUND"
    with pytest.raises(MillmError) as exc:
        client.sweep(prompts=PROMPTS, variants=[{"sae_id": sae.id, "index": FEATURE}], strengths=[])
    assert exc.value.code == "VALIDATION_ERROR" and "strengths" in json.dumps(exc.value.error)
    with pytest.raises(MillmError) as exc:
        client.attribution(sae.id, prompt="hi", target_token="several words at once")
    assert exc.value.code == "VALIDATION_ERROR"
