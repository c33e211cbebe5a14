"""miLLM's framework-free inference engine.

Nothing in this package imports Django. The light modules (``protocol``, ``errors``,
``inspect``, ``sae.config``/``sae.layouts`` metadata readers) do not import torch either,
so the web tier can use them to validate and describe work without loading the engine.
Torch-backed pieces (``engine``, ``backends``, ``hooks``, ``sae.module``) are imported on
demand.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
