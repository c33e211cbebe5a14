"""The canonical steering hash against its published test vectors
(tests/fixtures/steering_hash_vectors.json, also in docs/steering.md): the canonical texts
there were written by hand from the documented rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_engine.api.protocol import SteeringEntry, SteeringSpec

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "steering_hash_vectors.json").read_text())[
    "vectors"
]


def _spec(entries) -> SteeringSpec:
    return SteeringSpec([SteeringEntry(e["sae_id"], e["layer"], e["features"], e.get("controls", [])) for e in entries])


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_published_vectors(vector):
    spec = _spec(vector["steering"])
    assert spec.canonical_text() == vector["canonical_text"]
    assert spec.canonical_hash() == vector["hash"]


def test_any_change_to_what_is_added_changes_the_hash():
    base = SteeringSpec.from_mapping({("sae_a", 1): {3: 5.0}})
    for other in (
        {("sae_a", 1): {3: 5.000000001}},
        {("sae_a", 1): {4: 5.0}},
        {("sae_a", 2): {3: 5.0}},
        {("sae_b", 1): {3: 5.0}},
        {("sae_a", 1): {3: 5.0, 4: 1.0}},
    ):
        assert SteeringSpec.from_mapping(other).canonical_hash() != base.canonical_hash()
    assert SteeringSpec.from_mapping({("sae_a", 1): {3: 5}}).canonical_hash() == base.canonical_hash()
    assert SteeringSpec.from_mapping({("sae_a", 1): {3: -0.0}}).canonical_hash() == SteeringSpec([]).canonical_hash()
