"""Moved to ``gpu_engine.api.errors`` (issue 32): the engine's errors are part of its
torch-free API. This path stays for the engine modules that import it."""

from gpu_engine.api.errors import *  # noqa: F403
from gpu_engine.api.errors import _REGISTRY, __all__  # noqa: F401
