"""/v1's ``millm.sae_activations`` carries each feature's ``label`` when it has one (its
best explanation, registry.labels) and none when it has none, through the official openai
client's extra body, answered and streamed; another SAE's label of the same index is not
this SAE's."""

from __future__ import annotations

from registry.models import SAE, FeatureExplanation
from tests.v1.conftest import attach

ASKED = {"top_k": 4, "features": [3, 7], "positions": "all"}


def _entries(acts: dict) -> list[dict]:
    return [e for row in acts["positions"] for e in (*row["top_k"], *row["features"])]


def test_labelled_features_carry_their_label(llama, openai_client):
    sae = attach("tiny-llama-L1-relu", 1)
    FeatureExplanation.objects.create(sae=sae, index=3, description="sea words", source="user")
    FeatureExplanation.objects.create(sae=sae, index=3, description="the ocean", source="explainer", score=0.8)
    other = SAE.objects.get(name="tiny-llama-L3-relu")
    FeatureExplanation.objects.create(sae=other, index=7, description="another SAE's feature 7", source="user")

    resp = openai_client.completions.create(
        model="tiny-llama",
        prompt="the sea and the sky",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True, "return_sae_activations": ASKED},
    )
    acts = resp.model_extra["millm"]["sae_activations"]
    assert acts["sae_id"] == sae.id
    entries = _entries(acts)
    assert {e["feature_index"] for e in entries} >= {3, 7}
    for entry in entries:
        if entry["feature_index"] == 3:
            assert entry["label"] == "the ocean"  # the scored explanation is the label
        else:
            assert "label" not in entry, entry

    # a label of a top-k feature: written between two requests, read by the next one
    top_index = next(e["feature_index"] for row in acts["positions"] for e in row["top_k"] if e["feature_index"] != 3)
    FeatureExplanation.objects.create(sae=sae, index=top_index, description="a top feature", source="user")
    stream = openai_client.completions.create(
        model="tiny-llama",
        prompt="the sea and the sky",
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_sae_activations": ASKED},
    )
    millm = [chunk.model_extra["millm"] for chunk in stream if (chunk.model_extra or {}).get("millm")]
    assert len(millm) == 1
    streamed = millm[0]["sae_activations"]
    labelled = {e["feature_index"]: e.get("label") for e in _entries(streamed)}
    assert labelled[3] == "the ocean" and labelled[top_index] == "a top feature"
    assert all(label is None for index, label in labelled.items() if index not in (3, top_index))
    # the same positions and values as the answered request, labels aside
    strip = [
        [(e["feature_index"], e["activation"]) for e in (*row["top_k"], *row["features"])]
        for row in streamed["positions"]
    ]
    assert strip == [
        [(e["feature_index"], e["activation"]) for e in (*row["top_k"], *row["features"])] for row in acts["positions"]
    ]
