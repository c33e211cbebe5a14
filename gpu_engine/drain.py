"""Moved to ``gpu_engine.runtime.drain`` (issue 32); this module re-exports it."""

from .runtime.drain import *  # noqa: F403
from .runtime.drain import __all__  # noqa: F401
