"""Moved to ``gpu_engine.runtime.scheduler`` (issue 32); this module re-exports it."""

from .runtime.scheduler import *  # noqa: F403
from .runtime.scheduler import __all__  # noqa: F401
