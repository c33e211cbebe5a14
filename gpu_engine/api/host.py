"""What the web reads about the host before asking the engine: a model directory's
geometry, host memory, the names of the engine's backends and the site settings each
backend's load options come from (and the one that sizes a backend's own batch)."""

from gpu_engine.api.backends import backend_names, backend_option_settings, backend_rows_setting, batch_rows
from gpu_engine.api.model_dir import inspect_model_dir
from gpu_engine.api.memory import host_memory

__all__ = [
    "backend_names",
    "backend_option_settings",
    "backend_rows_setting",
    "batch_rows",
    "host_memory",
    "inspect_model_dir",
]
