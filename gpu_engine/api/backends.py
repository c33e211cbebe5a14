"""The backend registry: inference backends by name (``transformers``, ``vllm``,
``llamacpp``), in the style of the SAE layout registry (``gpu_engine.sae.layouts``).
It is declarations and ``importlib`` only (no torch, no adapter imported here), so it
sits in ``gpu_engine.api``: the web reads it (``gpu_engine.api.host``) and the runtime
loads through it (``gpu_engine.backends`` re-exports it), one table for both.

An entry names what the backend needs installed, the command that installs it, the
load options it takes (each with its type and the site setting it comes from: the web
tier reads them here through ``gpu_engine.api.host``, no second table), and where its
loader lives; the loader module is imported only
when a model is loaded on it, so a backend whose packages are missing costs nothing and
reports itself unavailable (``backends_report``) instead of failing at import.  Loading a
model on an unavailable backend raises ``BackendUnavailable`` (``backend_unavailable``,
400 on every surface) with the install command in its details.

What a loaded backend must do is ``gpu_engine.backends.base.ModelBackend``.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import BackendUnavailable, InvalidParameter

DEFAULT_BACKEND = "transformers"


@dataclass(frozen=True)
class Option:
    """A load option (``LoadModelJob.options``): its type, and the site setting the web tier
    fills it from (None: set per model, not from a setting)."""

    kind: type
    setting: str | None = None


@dataclass(frozen=True)
class BackendEntry:
    name: str
    summary: str
    # importable top-level packages the backend needs (checked without importing them)
    requires: tuple[str, ...]
    # the command that installs them (shown when they are missing)
    install: str
    # "module:function" of the loader: function(job, **context) -> ModelBackend
    loader: str
    # load options (``LoadModelJob.options``), each an ``Option`` (a bare type: one no
    # setting fills); anything else is refused
    options: Mapping[str, Option | type] = field(default_factory=dict)
    # optional "module:function(job)" refusing what the backend cannot honour in a load
    # job (values, combinations, the device) before anything drains or unloads
    validator: str = ""
    # optional "module:function()" saying, per registry quantization below 16 bits
    # (Q8, Q4, Q2), whether a load on this backend can apply it here and with what kernel
    # or why not; a backend without one applies none (``report``'s ``quantizations``)
    quantizations: str = ""
    # a backend that runs a batch of its own sizes it with this load option (vLLM's
    # max_num_seqs), ``rows_default`` when the job leaves it out: the engine's rows, and
    # /v1's slots, follow it unless the operator caps them (``batch_rows``)
    rows_option: str = ""
    rows_default: int = 0

    def __post_init__(self) -> None:
        options = {k: v if isinstance(v, Option) else Option(v) for k, v in self.options.items()}
        object.__setattr__(self, "options", options)

    def option_settings(self) -> dict[str, str]:
        """Each load option a site setting fills, and that setting's name."""
        return {k: o.setting for k, o in self.options.items() if isinstance(o, Option) and o.setting}

    def rows(self, options: Mapping[str, Any]) -> int | None:
        """The rows this backend's own batch runs with under load ``options`` (None: it
        has no batch of its own, the engine's BatchingOptions size it)."""
        if not self.rows_option:
            return None
        return int(options.get(self.rows_option) or self.rows_default) or None

    def missing(self) -> list[str]:
        return [name for name in self.requires if importlib.util.find_spec(name) is None]

    @property
    def available(self) -> bool:
        return not self.missing()

    def check_options(self, options: Mapping[str, Any]) -> None:
        for key, value in options.items():
            option = self.options.get(key)
            if option is None:
                known = ", ".join(sorted(self.options)) or "none"
                raise InvalidParameter(
                    f"the {self.name} backend takes no load option {key!r} (it takes: {known})", param=f"options.{key}"
                )
            kind = option.kind if isinstance(option, Option) else option
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise InvalidParameter(
                    f"load option {key!r} of the {self.name} backend must be a {kind.__name__}", param=f"options.{key}"
                )

    def check_job(self, job: Any) -> None:
        """Refuse ``job`` before anything drains: unknown options, wrong types, and what
        the backend's validator says it cannot honour (its packages must be installed)."""
        self.check_options(job.options)
        if self.validator:
            module_name, _, func = self.validator.partition(":")
            getattr(importlib.import_module(module_name), func)(job)

    def require(self) -> None:
        missing = self.missing()
        if missing:
            raise BackendUnavailable(
                f"The {self.name} backend is not installed here (missing: {', '.join(missing)}); "
                f"install it with `{self.install}`",
                details={"backend": self.name, "missing": missing, "install": self.install},
            )

    def load(self, job: Any, **context: Any) -> Any:
        """The loaded model (a ``ModelBackend``) for ``job``."""
        self.require()
        self.check_job(job)
        module_name, _, func = self.loader.partition(":")
        return getattr(importlib.import_module(module_name), func)(job, **context)

    def report(self) -> dict[str, Any]:
        missing = self.missing()
        quantizations: dict[str, Any] = {}
        if self.quantizations and not missing:
            module_name, _, func = self.quantizations.partition(":")
            quantizations = getattr(importlib.import_module(module_name), func)()
        return {
            "name": self.name,
            "summary": self.summary,
            "available": not missing,
            "missing": missing,
            "install": self.install,
            "options": sorted(self.options),
            "quantizations": quantizations,
        }


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(entry: BackendEntry) -> None:
    if entry.name in _BACKENDS:
        raise ValueError(f"backend {entry.name!r} is already registered")
    _BACKENDS[entry.name] = entry


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> BackendEntry:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise InvalidParameter(
            f"unknown backend {name!r}; known: {', '.join(_BACKENDS)}",
            param="backend",
            details={"backend": name, "known": list(_BACKENDS)},
        ) from None


# the report looks for packages on disk (~0.2 ms); every engine status carries it, and a
# status is read on each /v1 request, so it is kept for a few seconds (a package installed
# while the server runs shows within REPORT_TTL_S; a load checks its own packages afresh)
REPORT_TTL_S = 5.0
_report: tuple[tuple[int, ...], float, list[dict[str, Any]]] | None = None


def backend_option_settings(name: str) -> dict[str, str]:
    """The site settings ``name``'s load options come from, option → setting (empty for a
    backend not registered: its load is refused by name elsewhere)."""
    entry = _BACKENDS.get(name)
    return entry.option_settings() if entry is not None else {}


def batch_rows(max_batch_size: int, native: int | None, *, follow_backend: bool) -> int:
    """The interactive rows (and /v1 slots) a model gets: ``native`` (its backend's own
    batch, ``BackendEntry.rows``) when the operator left them to the backend, capped by
    ``native`` when the operator set ``max_batch_size`` (a row beyond the backend's batch
    would only wait inside it, unseen); ``max_batch_size`` for a backend without a batch
    of its own."""
    if native is None:
        return max_batch_size
    return native if follow_backend else min(max_batch_size, native)


def backend_rows_setting(name: str) -> tuple[str, int] | None:
    """The site setting that sizes ``name``'s own batch and the value it takes when unset
    (None: a backend without a batch of its own, or not registered)."""
    entry = _BACKENDS.get(name)
    if entry is None or not entry.rows_option:
        return None
    option = entry.options.get(entry.rows_option)
    setting = option.setting if isinstance(option, Option) else ""
    return (setting, entry.rows_default) if setting else None


def backends_report() -> list[dict[str, Any]]:
    """Every registered backend, whether it can load here, and how to install it."""
    global _report
    key, now = tuple(id(e) for e in _BACKENDS.values()), time.monotonic()
    if _report is None or _report[0] != key or now - _report[1] > REPORT_TTL_S:
        _report = (key, now, [entry.report() for entry in _BACKENDS.values()])
    return [dict(item) for item in _report[2]]


register_backend(
    BackendEntry(
        name="transformers",
        summary="PyTorch through Hugging Face transformers: safetensors checkpoints, our own continuous batching",
        requires=("torch", "transformers"),
        install="scripts/setup run",  # what the quick start installs: web + engine
        loader="gpu_engine.backends.transformers:load",
        # CPU float32: repack linear weights for oneDNN at load (backends/transformers/cpu_kernels.py);
        # quantization: the registry row's Q8/Q4, applied at load (transformers/quantization.py);
        # speculative_*: SPECULATIVE_MODEL's draft (transformers/speculative.py);
        # TORCH_COMPILE (absent: auto, compile on CUDA), TORCH_COMPILE_MODE, KV_CACHE_MODE:
        # backends/transformers/compiled.py; lean_decode (MILLM_ENGINE_LEAN_DECODE): the serial
        # and batched one-token step without model.forward, backends/transformers/lean.py;
        # fused_cpu_kernels (MILLM_ENGINE_FUSED_KERNELS): that step's small ops in C on CPU float32,
        # backends/transformers/cpu_fused.py
        options={
            "pack_cpu_weights": Option(bool, "MILLM_ENGINE_PACK_WEIGHTS"),
            "quantization": Option(str),  # the registry row's
            "speculative_model": Option(str, "SPECULATIVE_MODEL"),
            "speculative_num_tokens": Option(int, "SPECULATIVE_NUM_TOKENS"),
            "torch_compile": Option(bool, "TORCH_COMPILE"),
            "torch_compile_mode": Option(str, "TORCH_COMPILE_MODE"),
            "kv_cache_mode": Option(str, "KV_CACHE_MODE"),
            "lean_decode": Option(bool, "MILLM_ENGINE_LEAN_DECODE"),
            "fused_cpu_kernels": Option(bool, "MILLM_ENGINE_FUSED_KERNELS"),
            # PREFIX_CACHE_MAX_MB: gpu_engine/decode/prefix_cache.py
            "prefix_cache_max_mb": Option(int, "PREFIX_CACHE_MAX_MB"),
        },
        validator="gpu_engine.backends.transformers:check_job",
        quantizations="gpu_engine.backends.transformers.quantization:quantization_report",
    )
)

register_backend(
    BackendEntry(
        name="vllm",
        summary="vLLM's V1 engine: its scheduling, continuous batching and paged KV cache; tensor and "
        "pipeline parallelism over processes or a Ray cluster; steering and monitoring in its workers",
        requires=("vllm",),
        install="scripts/setup vllm",
        loader="gpu_engine.backends.vllm:load",
        validator="gpu_engine.backends.vllm:check_job",
        # from the site's VLLM_* settings
        options={
            "tensor_parallel_size": Option(int, "VLLM_TENSOR_PARALLEL_SIZE"),
            "pipeline_parallel_size": Option(int, "VLLM_PIPELINE_PARALLEL_SIZE"),
            "distributed_executor_backend": Option(str, "VLLM_DISTRIBUTED_EXECUTOR"),
            "gpu_memory_utilization": Option(float, "VLLM_GPU_MEMORY_UTILIZATION"),
            "max_model_len": Option(int, "VLLM_MAX_MODEL_LEN"),
            "max_num_seqs": Option(int, "VLLM_MAX_NUM_SEQS"),
            "enforce_eager": Option(bool, "VLLM_ENFORCE_EAGER"),
        },
        # vLLM schedules at most max_num_seqs sequences per step (its own default 16)
        rows_option="max_num_seqs",
        rows_default=16,
    )
)

register_backend(
    BackendEntry(
        name="llamacpp",
        summary="GGUF models through llama.cpp (llama-cpp-python): control vectors and the "
        "eval callback for steering and monitoring, multi-sequence batches",
        requires=("llama_cpp",),
        install="scripts/setup llamacpp",
        loader="gpu_engine.backends.llamacpp:load",
        validator="gpu_engine.backends.llamacpp:check_job",
        # from the site's GGUF_* settings (backends/llamacpp/options.py says what each does)
        options={
            "context_length": Option(int, "GGUF_CONTEXT_LENGTH"),
            "kv_cache_type": Option(str, "GGUF_KV_CACHE_TYPE"),
            "flash_attention": Option(bool, "GGUF_FLASH_ATTENTION"),
            "tensor_split": Option(list, "GGUF_TENSOR_SPLIT"),
            "enable_embeddings": Option(bool, "GGUF_ENABLE_EMBEDDINGS"),
            "steering_mode": Option(str, "GGUF_STEERING_MODE"),
            "gguf_file": Option(str),
            "prefix_cache_max_mb": Option(int, "PREFIX_CACHE_MAX_MB"),  # decode/prefix_cache.py
        },  # the registry row's
    )
)

__all__ = [
    "DEFAULT_BACKEND",
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
