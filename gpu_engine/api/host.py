"""What the web reads about the host before asking the engine: a model directory's
geometry, host memory, and the names of the engine's backends."""

from gpu_engine.backends import backend_names
from gpu_engine.inspect import inspect_model_dir
from gpu_engine.memory import host_memory

__all__ = ["backend_names", "host_memory", "inspect_model_dir"]
