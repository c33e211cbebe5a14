"""The engine's backends: ``transformers``, ``vllm`` and ``llamacpp``, each an adapter
package here, loaded by name through the registry (``gpu_engine.api.backends``, re-exported
for the runtime). What a loaded backend must do is ``gpu_engine.backends.base.ModelBackend``.
"""

from ..api.backends import (
    DEFAULT_BACKEND,
    REPORT_TTL_S,
    BackendEntry,
    Option,
    backend_names,
    backend_option_settings,
    backend_rows_setting,
    backends_report,
    batch_rows,
    get_backend,
    register_backend,
)

__all__ = [
    "DEFAULT_BACKEND",
    "REPORT_TTL_S",
    "BackendEntry",
    "Option",
    "backend_names",
    "backend_option_settings",
    "backend_rows_setting",
    "batch_rows",
    "backends_report",
    "get_backend",
    "register_backend",
]
