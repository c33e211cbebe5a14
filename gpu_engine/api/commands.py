"""The engine's command table (see ``gpu_engine.commands``): one declaration both sides use."""

from gpu_engine import commands as _commands
from gpu_engine.commands import *  # noqa: F403  (the names of its __all__)

__all__ = list(_commands.__all__)
