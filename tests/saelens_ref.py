"""SAELens's own inference SAE classes, as the reference our SAE code is compared with.

``sae-lens`` is a test-only dependency (requirements/saelens-test.txt), installed by
``scripts/setup test`` *without its dependencies*: they pin a transformer-lens whose own
pins (transformers, wandb, …) clash with ours.  The inference classes (``sae_lens.saes``)
need only torch, safetensors, numpy, einops, yaml and huggingface_hub, which we have, plus
two names from transformer-lens: ``HookPoint`` (an identity module SAELens places between
steps so users can hook them) and ``HookedRootModule`` (an ``nn.Module`` whose
``setup()`` indexes those hook points).  Neither changes a number, so the identity stand-ins
below replace them, and the package's ``__init__`` (which imports the training stack:
wandb, datasets, plotly) is bypassed; the SAE classes, their registry and the disk loader
are SAELens's own files, unchanged.

Where sae-lens is missing the tests skip with the install command, unless
``MILLM_REQUIRE_SAELENS=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from functools import cache
from importlib.metadata import version
from typing import Any

import pytest
import torch

INSTALL = ".venv/bin/python -m pip install --no-deps -r requirements/saelens-test.txt (scripts/setup test does it)"
ARCHITECTURES = {
    "standard": ("standard_sae", "StandardSAE", "StandardSAEConfig"),
    "gated": ("gated_sae", "GatedSAE", "GatedSAEConfig"),
    "jumprelu": ("jumprelu_sae", "JumpReLUSAE", "JumpReLUSAEConfig"),
    "topk": ("topk_sae", "TopKSAE", "TopKSAEConfig"),
    "transcoder": ("transcoder", "Transcoder", "TranscoderConfig"),
    "jumprelu_transcoder": ("transcoder", "JumpReLUTranscoder", "JumpReLUTranscoderConfig"),
}


def _stand_ins() -> None:
    """transformer-lens's two names, as identities, unless the real package is importable."""
    if importlib.util.find_spec("transformer_lens") is not None:
        return

    class HookPoint(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class HookedRootModule(torch.nn.Module):
        def setup(self) -> None:
            pass

    root = types.ModuleType("transformer_lens")
    hook_points = types.ModuleType("transformer_lens.hook_points")
    hooked = types.ModuleType("transformer_lens.HookedTransformer")
    hook_points.HookPoint = HookPoint  # type: ignore[attr-defined]
    hooked.HookedRootModule = HookedRootModule  # type: ignore[attr-defined]
    root.hook_points, root.HookedTransformer = hook_points, hooked  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "transformer_lens": root,
            "transformer_lens.hook_points": hook_points,
            "transformer_lens.HookedTransformer": hooked,
        }
    )


@cache
def _load() -> types.SimpleNamespace:
    spec = importlib.util.find_spec("sae_lens")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sae_lens")
    if "sae_lens" not in sys.modules:
        package = types.ModuleType("sae_lens")
        package.__path__ = list(spec.submodule_search_locations)
        package.__version__ = version("sae-lens")  # type: ignore[attr-defined]
        package.logger = logging.getLogger("sae_lens")  # type: ignore[attr-defined]
        sys.modules["sae_lens"] = package
    _stand_ins()
    try:
        registry = importlib.import_module("sae_lens.registry")
    except ModuleNotFoundError:
        # a dependency is missing: take the stand-in package back out, so every test asks
        # again and skips (or fails under MILLM_REQUIRE_SAELENS) with the same reason
        sys.modules.pop("sae_lens", None)
        raise
    sae_module = importlib.import_module("sae_lens.saes.sae")
    classes: dict[str, Any] = {}
    for arch, (mod, cls, cfg_cls) in ARCHITECTURES.items():
        module = importlib.import_module(f"sae_lens.saes.{mod}")
        classes[arch] = (getattr(module, cls), getattr(module, cfg_cls))
        if arch not in registry.SAE_CLASS_REGISTRY:
            registry.register_sae_class(arch, *classes[arch])
    return types.SimpleNamespace(SAE=sae_module.SAE, classes=classes, version=version("sae-lens"))


def saelens() -> types.SimpleNamespace:
    """``SAE`` (SAELens's base class: ``load_from_disk``), ``classes`` {architecture:
    (SAE class, config class)}, ``version``; skips or fails where sae-lens is missing."""
    try:
        return _load()
    except ModuleNotFoundError as exc:
        reason = f"sae-lens is not installed ({exc.name}): {INSTALL}"
        if os.environ.get("MILLM_REQUIRE_SAELENS") == "1":
            pytest.fail(f"MILLM_REQUIRE_SAELENS=1 but {reason}")
        pytest.skip(reason)
