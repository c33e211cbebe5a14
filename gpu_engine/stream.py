"""Moved to ``gpu_engine.runtime.stream`` (issue 32); this module re-exports it."""

from .runtime.stream import *  # noqa: F403
from .runtime.stream import __all__  # noqa: F401
