"""Sample documents the UI tests import so every page has something to draw: a cluster on
the tiny Llama's layer-1 SAE and a two-layer circuit (layers 1 and 3) with one edge below
and one above the validation rung."""

from __future__ import annotations

CLUSTER = {
    "kind": "mistudio.cluster-definition",
    "schema_version": "1",
    "name": "calm-register",
    "narrative": "Three features that together move the register towards calm, formal text.",
    "members": [
        {"feature_idx": 1, "strength": 12, "label": "formal"},
        {"feature_idx": 2, "strength": -6, "label": "slang"},
        {"feature_idx": 3, "strength": 8, "sign": -1, "label": "shouting"},
    ],
    "model": {"hf_id": "tiny-llama"},
    "sae": {"sae_id": "tiny-llama-L1-relu", "n_features": 256, "layer": 1},
    "budget": {"intensity": 1.0, "intensity_range": [0.0, 2.0]},
}

CIRCUIT = {
    "kind": "mistudio.circuit-definition",
    "schema_version": "1",
    "name": "greeting-chain",
    "narrative": "A greeting feature on layer 1 that drives two layer-3 features.",
    "saes": [
        {"sae_id": "tiny-llama-L1-relu", "layer": 1, "n_features": 256},
        {"sae_id": "tiny-llama-L3-relu", "layer": 3, "n_features": 256},
    ],
    "members": [
        {"layer": 1, "feature": {"feature_idx": 10, "strength": 20, "label": "greeting"}},
        {"layer": 1, "feature": {"feature_idx": 11, "strength": -8, "label": "farewell"}},
        {
            "layer": 3,
            "member_kind": "cluster_ref",
            "cluster_name": "politeness",
            "expanded_members": [
                {"feature_idx": 20, "strength": 15, "label": "please"},
                {"feature_idx": 21, "strength": 5, "label": "thanks"},
            ],
        },
    ],
    "edges": [
        {"up": {"layer": 1, "feature_idx": 10}, "down": {"layer": 3, "feature_idx": 20}, "rung": 2, "type": "computed"},
        {
            "up": {"layer": 1, "feature_idx": 11},
            "down": {"layer": 3, "feature_idx": 21},
            "rung": 1,
            "type": "persistence",
        },
    ],
    "budget": {"intensity": 1.0, "intensity_range": [0.0, 2.0]},
}

PROFILE = {
    "version": "1.0",
    "name": "imported-profile",
    "description": "From a file",
    "sae_id": None,
    "layer": 1,
    "steering": {"4": 9.5, "9": -3},
}
