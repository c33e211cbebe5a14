"""The backend contract: what a loaded model must do for the engine.

The engine (``gpu_engine.runtime``) keeps what is the same on every backend: the
attachment table, drain-before-control ordering, the OOM policy, events, admission of
generations into its batch scheduler (``gpu_engine.runtime.scheduler``) and the per-request plans
(``gpu_engine.runtime.prepare``: steering deltas and monitors, built from the attachment's SAE
with ``gpu_engine.interp.hooks`` — plain torch, importable without any backend).  A backend owns
the rest: loading, tokenisation, how rows run (its ``BatchBackend``: start requests, step
them, drop one, reset), applying steering and monitoring for an attachment wherever its
model lives, embeddings, scoring, and the capabilities it reports.

A backend is registered in ``gpu_engine.backends`` with a loader ``load(job, *, hooks)``
returning an object of this shape.  ``hooks`` is the engine's ``HookManager``: a backend
running the model in this process installs the attachment's hook on the module it names;
one running it elsewhere (worker processes) carries the same plans there.

``ModelBackend`` is every member the runtime reads; a loader's result lacking one fails
the load by name (``missing_members``).  What only some backends can do is a small
protocol of its own (``ReadsHiddenStates``, ``ReleasesCachedMemory``, ``ComputesAttribution``;
on the batch runner ``CachesRows`` and ``CountsLeanSteps``; ``CompilesGrammars`` lives with
its reader in ``gpu_engine.decode.sequence``, which imports no backend), asked with ``isinstance``:
the runtime never probes a backend for a name.  What a backend can do as loaded is its
``capabilities()``, a typed ``gpu_engine.api.capabilities.Capabilities``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..api.capabilities import Capabilities
    from ..interp.capture import AttentionGeometry
    from ..interp.hooks import AttachmentStats, RequestHooks
    from ..api.protocol import (
        AttachmentKey,
        AttributionJob,
        AttributionResult,
        EmbedJob,
        EmbedResult,
        FinishEvent,
        GenerationEvent,
        GenerationJob,
        HiddenStatesJob,
        HiddenStatesResult,
        LoadModelJob,
        SamplingParams,
        ScoreJob,
        ScoreResult,
    )
    from ..sae.module import SAE


class AttachedSAE(Protocol):
    """An SAE the runtime attached (``gpu_engine.runtime.attachments.Attachment``), as a
    backend sees it in ``attach``: declared here so that a backend names no runtime module."""

    sae_id: str
    layer: int
    layer_module_path: str
    sae: SAE
    stats: AttachmentStats

    @property
    def hook_point(self) -> str: ...

    @property
    def key(self) -> AttachmentKey: ...


class BatchBackend(Protocol):
    """What runs the rows of the engine's continuous batch (``ModelBackend.batch_runner``);
    the scheduler (``gpu_engine.runtime.scheduler``) decides who runs, this runs them."""

    rows: list[Any]
    steps: int

    def start(self, seqs: list[Any]) -> list[Any]: ...

    def step(self) -> list[Any]: ...

    def remove(self, seq: Any) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class ModelBackend(Protocol):
    name: str
    # the loaded job (its model_id names captures)
    job: LoadModelJob
    device: torch.device
    # where the engine keeps an attached SAE's tensors: the model's device, or the host
    # for a backend whose model lives in other processes (vLLM keeps its own copy there)
    sae_device: torch.device
    dtype: torch.dtype
    context_length: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: set[int]
    # the matmul kernels in use ("default", "onednn_packed", ...), for status
    kernels: str
    # what the weights are and what they take in memory (``EngineStatus.weights``; empty
    # where the backend does not say)
    weights: dict[str, Any]
    # attention heads for Q/K capture (None where the backend cannot read them)
    attention_geometry: AttentionGeometry | None
    # True where worker processes take a capture's rows (vLLM): the request's plan only
    # packs their parts, it allocates no buffer of its own
    captures_in_workers: bool

    def capabilities(self) -> Capabilities:
        """What this backend can do as loaded (``gpu_engine.api.capabilities``): the engine
        refuses a request needing what it lacks, before anything runs."""
        ...

    # ---- tokens
    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_messages(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def unembedding(self) -> torch.Tensor:
        """The model's unembedding ``W_U`` [vocab, d_model] as the checkpoint holds it
        (the output head, or the tied input embedding), float32, no final norm: what a
        feature's logit effect is read through (``Engine.feature_logits``)."""
        ...

    # ---- attachments: steering and monitoring for one (sae_id, layer)
    def layer_module_path(self, layer: int, hook_point: str = ...) -> str: ...

    def attach(self, attachment: AttachedSAE) -> None: ...

    def detach(self, key: AttachmentKey) -> None: ...

    def attention_scaling(self, layer: int) -> float | None:
        """The softmax scale of ``layer``'s attention (captures record it)."""
        ...

    # ---- generation
    def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        request_hooks: RequestHooks | None,
        should_stop: Callable[[], bool],
        emit: Callable[[GenerationEvent], None],
        distributions_from: int | None = None,
    ) -> FinishEvent:
        """One generation run to its end on the caller's thread (serial mode);
        ``distributions_from``: the job's (``GenerationJob.distributions_from``), checked
        against the prompt and the capability ``prompt_distributions`` already."""
        ...

    def batch_runner(self, *, max_rows: int) -> BatchBackend:
        """What runs the rows of the engine's continuous batch on this model."""
        ...

    def new_sequence(
        self,
        job: GenerationJob,
        *,
        prompt_ids: list[int],
        max_tokens: int,
        request_hooks: RequestHooks | None,
        emit: Callable[[GenerationEvent], None],
        should_stop: Callable[[], bool],
    ) -> Any:
        """A request's decode state for ``batch_runner``'s rows."""
        ...

    # ---- one-shot work (no steering: embeddings and scores read the unsteered model)
    def embed(self, job: EmbedJob, inputs: Sequence[list[int]]) -> EmbedResult: ...

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult: ...

    def close(self) -> None: ...


# ---- optional abilities: asked with isinstance, each backend has them or not


@runtime_checkable
class Closeable(Protocol):
    """Something that holds resources until closed (a loader's result that broke the
    contract is still closed when it can be)."""

    def close(self) -> None: ...


@runtime_checkable
class ReadsHiddenStates(Protocol):
    """Pooled residuals after chosen blocks, unsteered (capability ``hidden_states``)."""

    def hidden_states(self, job: HiddenStatesJob, inputs: Sequence[list[int]]) -> HiddenStatesResult: ...


@runtime_checkable
class ComputesAttribution(Protocol):
    """A logit attributed to an attached SAE's features by its gradient (capability
    ``gradients``; ``Engine.attribution`` checks the job, the ids and the target first and
    runs this on its worker, between two steps of the batch)."""

    def attribution(
        self, job: AttributionJob, prompt_ids: list[int], attachment: AttachedSAE, target_token_id: int | None
    ) -> AttributionResult: ...


@runtime_checkable
class ReleasesCachedMemory(Protocol):
    """Memory kept between requests that the engine's idle release hands back."""

    def release_cached_memory(self) -> None: ...


@runtime_checkable
class CachesRows(Protocol):
    """A batch runner keeping per-row memory (a KV slab) between requests."""

    def cached_bytes(self) -> int: ...

    def release_cached(self) -> int:
        """Drop what ``cached_bytes`` counts while no row runs; the bytes freed."""
        ...


@runtime_checkable
class ReportsKV(Protocol):
    """A batch runner that can say what its KV cache holds (engine metrics): a dict with
    ``bytes_in_use`` (the running rows' keys and values), ``capacity_bytes`` (what is
    reserved for them, None where unknown) and ``source`` (how it was measured). Read on
    any thread while the worker runs: a racy figure is fine."""

    def kv_usage(self, running: list[Any]) -> dict[str, Any] | None: ...


@runtime_checkable
class CountsLeanSteps(Protocol):
    """A batch runner some of whose decode steps skip ``model.forward`` (transformers' lean step)."""

    lean_steps: int


def _members(protocol: type) -> list[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return sorted(names)


def missing_members(backend: object) -> list[str]:
    """The ``ModelBackend`` members ``backend`` lacks (a loader's result is checked with it)."""
    present = set(dir(backend))
    return [n for n in _members(ModelBackend) if n not in present]


__all__ = [
    "AttachedSAE",
    "BatchBackend",
    "CachesRows",
    "Closeable",
    "ComputesAttribution",
    "CountsLeanSteps",
    "ModelBackend",
    "ReadsHiddenStates",
    "ReleasesCachedMemory",
    "missing_members",
]
