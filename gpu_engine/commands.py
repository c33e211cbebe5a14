"""Moved to ``gpu_engine.api.commands`` (issue 32): the command table is part of the
engine's torch-free API. This path stays for the engine modules that import it."""

from gpu_engine.api.commands import *  # noqa: F403
from gpu_engine.api.commands import __all__  # noqa: F401
