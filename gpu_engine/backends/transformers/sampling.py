"""Moved to ``gpu_engine.decode.sampling`` (backend-neutral; llama.cpp samples with it too).
This re-export keeps the old path working until its last importer moves."""

from ...decode.sampling import Sampler, choose_rows, sample_rows, score_result

__all__ = ["Sampler", "choose_rows", "sample_rows", "score_result"]
