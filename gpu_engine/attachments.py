"""Moved to ``gpu_engine.runtime.attachments`` (issue 32); this module re-exports it."""

from .runtime.attachments import *  # noqa: F403
from .runtime.attachments import __all__  # noqa: F401
