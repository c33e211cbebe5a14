"""What a built asset directory contains, as plain dataclasses with a JSON form.

Paths are stored relative to the asset root in ``manifest.json`` so a cache directory
can be moved or mounted elsewhere (CI caches, containers) and still load.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from offline_assets.saes import hook_name


@dataclass(frozen=True)
class ModelAsset:
    """A saved causal LM (safetensors + tokenizer + generation config) under ``path``."""

    name: str
    path: Path
    arch: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    architecture_class: str
    layers_path: str = "model.layers"
    dtype: str = "float32"

    def layer_module_path(self, layer: int) -> str:
        """The dotted module path of decoder block ``layer`` (what the engine hooks)."""
        return f"{self.layers_path}.{layer}"


@dataclass(frozen=True)
class SAEAsset:
    """A saved SAE for the residual stream after block ``layer`` of ``model_name``.

    ``feature_labels`` and ``steering_strength`` are only set for SAEs whose features
    were built from real contrasting prompts (the demo SAE): labelled feature index →
    label, and a strength at which steering with any of them visibly changes greedy text.
    """

    name: str
    path: Path
    layout: str
    activation: str
    d_in: int
    d_sae: int
    layer: int
    model_name: str
    k: int | None = None
    feature_labels: dict[int, str] = field(default_factory=dict, hash=False)
    steering_strength: float | None = None

    @property
    def hook_name(self) -> str:
        return hook_name(self.layer)


@dataclass(frozen=True)
class AssetManifest:
    """Everything one ``ensure_assets`` call built, keyed by asset name."""

    root: Path
    models: dict[str, ModelAsset] = field(hash=False)
    saes: dict[str, SAEAsset] = field(hash=False)
    builder_version: str = ""
    seed: int = 0
    build_key: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def saes_for(self, model_name: str) -> list[SAEAsset]:
        """The SAEs built for ``model_name``, in layer order."""
        return sorted(
            (sae for sae in self.saes.values() if sae.model_name == model_name),
            key=lambda sae: (sae.layer, sae.name),
        )

    def subset(self, model_names: set[str]) -> AssetManifest:
        """The same manifest restricted to some models and their SAEs."""
        return AssetManifest(
            root=self.root,
            models={n: m for n, m in self.models.items() if n in model_names},
            saes={n: s for n, s in self.saes.items() if s.model_name in model_names},
            builder_version=self.builder_version,
            seed=self.seed,
            build_key=dict(self.build_key),
        )

    def to_json(self) -> str:
        """Serialise with paths relative to ``root``."""

        def rel(path: Path) -> str:
            try:
                return Path(path).relative_to(self.root).as_posix()
            except ValueError:
                return str(path)

        def entry(asset: ModelAsset | SAEAsset) -> dict[str, Any]:
            data = asdict(asset)
            data["path"] = rel(asset.path)
            if isinstance(asset, SAEAsset):
                data["feature_labels"] = {str(i): label for i, label in sorted(asset.feature_labels.items())}
            return data

        payload = {
            "root": str(self.root),
            "builder_version": self.builder_version,
            "seed": self.seed,
            "build_key": self.build_key,
            "models": {name: entry(m) for name, m in sorted(self.models.items())},
            "saes": {name: entry(s) for name, s in sorted(self.saes.items())},
        }
        return json.dumps(payload, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, root: Path | None = None) -> AssetManifest:
        """Parse ``manifest.json`` text, resolving relative paths against ``root``.

        Without ``root`` the directory the manifest was written in is used.
        """
        payload = json.loads(text)
        root = Path(root) if root is not None else Path(payload["root"])

        def model(data: dict[str, Any]) -> ModelAsset:
            return ModelAsset(**{**data, "path": root / data["path"]})

        def sae(data: dict[str, Any]) -> SAEAsset:
            labels = {int(i): label for i, label in data.get("feature_labels", {}).items()}
            return SAEAsset(**{**data, "path": root / data["path"], "feature_labels": labels})

        return cls(
            root=root,
            models={name: model(d) for name, d in payload["models"].items()},
            saes={name: sae(d) for name, d in payload["saes"].items()},
            builder_version=payload["builder_version"],
            seed=payload["seed"],
            build_key=payload.get("build_key", {}),
        )
