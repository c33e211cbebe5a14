"""Moved to ``gpu_engine.runtime.engine`` (issue 32), split along its concerns
(``runtime.worker``, ``runtime.status``, ``runtime.loading``); this module re-exports it."""

from .runtime.engine import *  # noqa: F403
from .runtime.engine import __all__  # noqa: F401
from .runtime.worker import _BATCH_WORK, _CONTROL, _WORK, _Task, _priority  # noqa: F401
