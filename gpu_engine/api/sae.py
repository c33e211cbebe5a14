"""SAE metadata, compatibility and steering-vector files, read without torch
(``gpu_engine.sae``: its torch module, ``SAE``/``load_sae``, is not re-exported here)."""

from gpu_engine.api.results import CompatibilityReport
from gpu_engine.sae.compat import check_compatibility
from gpu_engine.sae.config import SAEConfig
from gpu_engine.sae.layouts import read_sae_metadata
from gpu_engine.sae.vectors import read_vector_header, read_vectors, write_vector_file

__all__ = [
    "CompatibilityReport",
    "SAEConfig",
    "check_compatibility",
    "read_sae_metadata",
    "read_vector_header",
    "read_vectors",
    "write_vector_file",
]
