"""Moved to ``gpu_engine.interp.capture`` (issue 32); this module re-exports it."""

from .interp.capture import *  # noqa: F403
from .interp.capture import __all__, is_pair  # noqa: F401
