"""Moved to ``gpu_engine.interp.hooks`` (issue 32).  This name is the same module object, so
a test that patches a module constant here (``FLUSH_CHUNK_ROWS``) patches the one the code
reads."""

import sys

from .interp import hooks as _hooks

sys.modules[__name__] = _hooks
