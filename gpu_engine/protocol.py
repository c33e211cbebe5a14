"""Moved to ``gpu_engine.api`` (issue 32): the protocol is the engine's torch-free API,
split by concern there (``gpu_engine.api.protocol`` names every part). This path stays
for the engine modules that import it."""

from gpu_engine.api.protocol import *  # noqa: F403
from gpu_engine.api.protocol import __all__  # noqa: F401
