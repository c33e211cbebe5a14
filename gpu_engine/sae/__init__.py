"""Sparse autoencoders: configs, layouts, compatibility and the torch module.

``SAEConfig``, ``read_sae_metadata`` and ``check_compatibility`` import no torch; ``SAE``
and ``load_sae`` do, and are resolved on first use.
"""

from __future__ import annotations

from typing import Any

from .compat import check_compatibility
from .config import ACTIVATIONS, SAEConfig
from .layouts import (
    SAELayout,
    detect_layout,
    read_sae_metadata,
    register_layout,
    registered_layouts,
)
from .vectors import LAYOUT as VECTOR_LAYOUT  # registers the "vector" layout after the SAE ones

_LAZY = {"SAE": "module", "load_sae": "module"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)


__all__ = [
    "ACTIVATIONS",
    "SAE",
    "SAEConfig",
    "SAELayout",
    "VECTOR_LAYOUT",
    "check_compatibility",
    "detect_layout",
    "load_sae",
    "read_sae_metadata",
    "register_layout",
    "registered_layouts",
]
