"""Two /v1 requests with different probes share decode steps on the continuous-batching
engine (no serial fallback) and each gets its own verdict, equal to its verdict alone."""

from __future__ import annotations


import pytest

from tests.batching.test_v1 import batching_server  # noqa: F401 - fixture
from tests.engine.tolerances import BATCH_ENCODE_ATOL
from tests.v1.conftest import _v1_db, attach, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import request

from .conftest import Choreography

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_requests_with_different_probes_in_one_batch(batching_server):  # noqa: F811
    server = batching_server
    sae = attach("tiny-llama-L1-relu", 1)
    for name, features, weights in (("a", [1, 2], [1.0, -1.0]), ("b", [3, 7, 9], [0.5, 0.5, 2.0])):
        resp = request(
            server.url,
            "POST",
            "/api/probes",
            {
                "name": name,
                "sae_id": sae.id,
                "layer": 1,
                "features": features,
                "weights": weights,
                "threshold": 0.0,
                "positions": "mean",
            },
        )
        assert resp.status == 201, resp.body
        assert request(server.url, "POST", f"/api/probes/{name}/validate").status == 200
    base = {"model": "tiny-llama", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    bodies = {
        "a": {**base, "prompt": "the sea and the sky", "probes": ["a"]},
        "b": {**base, "prompt": "a quick brown fox", "probes": ["b"]},
    }
    alone = {k: request(server.base_url, "POST", "/completions", b).json() for k, b in bodies.items()}
    together: dict[str, dict] = {}

    def send(name: str) -> None:
        together[name] = request(server.base_url, "POST", "/completions", bodies[name]).json()

    choreo = Choreography(server.engine.backend.model)
    choreo.run_together(send, bodies)
    assert max(choreo.batch_sizes) >= 2, choreo.batch_sizes  # they shared decode steps
    for name in bodies:
        (got,) = together[name]["millm"]["probes"]
        (want,) = alone[name]["millm"]["probes"]
        assert got["name"] == name and got["rows"] == 16
        assert got["score"] == pytest.approx(want["score"], abs=BATCH_ENCODE_ATOL * 10)
        assert got["verdict"] == want["verdict"]
        assert together[name]["choices"][0]["text"] == alone[name]["choices"][0]["text"]
