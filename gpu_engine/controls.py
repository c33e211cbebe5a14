"""Moved to ``gpu_engine.interp.controls`` (issue 32); this module re-exports it."""

from .interp.controls import *  # noqa: F403
from .interp.controls import __all__  # noqa: F401
