"""miLLM's framework-free inference engine.

Nothing in this package imports Django. Its packages are layered (an import-linter contract,
docs/engine.md): ``server`` > ``runtime`` > ``backends`` > ``decode`` > ``interp`` >
``sae`` | ``analysis`` > ``api``. ``api`` imports no torch: the protocol, errors and command
table, and the readers the web tier uses to validate and describe work without loading the
engine (model directories, SAE metadata, stored captures). Torch-backed pieces
(``runtime``, the backends' adapters, ``interp.hooks``, ``sae.module``) are imported on demand.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
