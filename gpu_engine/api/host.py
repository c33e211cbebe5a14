"""What the web reads about the host before asking the engine: a model directory's
geometry, host memory, the names of the engine's backends and the site settings each
backend's load options come from."""

from gpu_engine.backends import backend_names, backend_option_settings
from gpu_engine.api.model_dir import inspect_model_dir
from gpu_engine.api.memory import host_memory

__all__ = ["backend_names", "backend_option_settings", "host_memory", "inspect_model_dir"]
