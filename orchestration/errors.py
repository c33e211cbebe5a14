"""Orchestration's errors: what a change of the engine's model can meet."""

from __future__ import annotations

from core.errors import ModelBusy


class LoadInProgress(ModelBusy):
    """Another process (or thread) claimed this model's load first; wait for it instead
    of starting a second one (``model_load_wait``)."""
