"""The backend contract: what a loaded model must do for the engine.

The engine (``gpu_engine.engine``) keeps what is the same on every backend: the
attachment table, drain-before-control ordering, the OOM policy, events, admission of
generations into its batch scheduler (``gpu_engine.scheduler``) and the per-request plans
(``gpu_engine.requests``: steering deltas and monitors, built from the attachment's SAE
with ``gpu_engine.hooks`` — plain torch, importable without any backend).  A backend owns
the rest: loading, tokenisation, how rows run (its ``BatchBackend``: start requests, step
them, drop one, reset), applying steering and monitoring for an attachment wherever its
model lives, embeddings, scoring, and the capabilities it reports.

A backend is registered in ``gpu_engine.backends`` with a loader ``load(job, *, hooks)``
returning an object of this shape.  ``hooks`` is the engine's ``HookManager``: a backend
running the model in this process installs the attachment's hook on the module it names;
one running it elsewhere (worker processes) carries the same plans there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..attachments import Attachment
    from ..hooks import RequestHooks
    from ..protocol import (
        AttachmentKey,
        EmbedJob,
        EmbedResult,
        FinishEvent,
        GenerationJob,
        SamplingParams,
        ScoreJob,
        ScoreResult,
    )
    from ..scheduler import BatchBackend

# What every backend reports, each True or False (``capabilities()``); a backend may add
# its own keys.  The engine refuses (``invalid_parameter`` naming the field, before
# anything runs) a request needing a capability the backend lacks
# (``requests.check_capabilities``; embeddings and scoring in ``Engine.embed``/``score``).
CAPABILITY_KEYS = (
    "per_request_sampling",
    "per_request_seeds",
    "stop_sequences",
    "cancellation",
    "per_request_steering",
    # feature controls beyond a plain add (clamp, scale, ablate, phases, windows,
    # conditions: ``FeatureControl``), per request
    "steering_controls",
    "per_request_monitoring",
    "exact_monitoring_attribution",
    "logprobs",
    "prompt_logprobs",
    "embeddings",
    "scoring",
    # the generation modes it runs: one at a time (``generate``), the engine's batch
    # (``batch_runner``)
    "serial_mode",
    "batched_mode",
    # GenerationJob.capture: hidden states of chosen layers per request (gpu_engine.capture)
    "hidden_state_capture",
    # CaptureSpec.attention: rotated Q and K of chosen layers and heads per request
    "attention_capture",
    # SamplingParams.structured (/v1 response_format): per-request grammar masks, in a
    # batch on that request's row only
    "structured_output",
    # GenerationJob.tools: the chat template renders tools (a backend whose template does
    # reports it, with ``tool_call_format``: gpu_engine.protocol.TOOL_CALL_FORMATS)
    "tool_calling",
)


def all_capabilities(**overrides: Any) -> dict[str, Any]:
    """Every ``CAPABILITY_KEYS`` True, then a backend's ``overrides`` (what it lacks, and
    keys of its own): what a backend's ``capabilities()`` starts from."""
    return {**dict.fromkeys(CAPABILITY_KEYS, True), **overrides}


@runtime_checkable
class ModelBackend(Protocol):
    name: str
    device: torch.device
    dtype: torch.dtype
    context_length: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: set[int]
    # the matmul kernels in use ("default", "onednn_packed", ...), for status
    kernels: str

    def capabilities(self) -> dict[str, bool]: ...

    # ---- tokens
    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_messages(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                        **kwargs: Any) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    # ---- attachments: steering and monitoring for one (sae_id, layer)
    def layer_module_path(self, layer: int) -> str: ...

    def attach(self, attachment: Attachment) -> None: ...

    def detach(self, key: AttachmentKey) -> None: ...

    # ---- generation
    def generate(self, *, request_id: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
                 request_hooks: RequestHooks | None, should_stop: Callable[[], bool],
                 emit: Callable[[Any], None]) -> FinishEvent:
        """One generation run to its end on the caller's thread (serial mode)."""
        ...

    def batch_runner(self, *, max_rows: int) -> BatchBackend:
        """What runs the rows of the engine's continuous batch on this model."""
        ...

    def new_sequence(self, job: GenerationJob, *, prompt_ids: list[int], max_tokens: int,
                     request_hooks: RequestHooks | None, emit: Callable[[Any], None],
                     should_stop: Callable[[], bool]) -> Any:
        """A request's decode state for ``batch_runner``'s rows."""
        ...

    # ---- one-shot work (no steering: embeddings and scores read the unsteered model)
    def embed(self, job: EmbedJob, inputs: Sequence[list[int]]) -> EmbedResult: ...

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult: ...

    def close(self) -> None: ...


def missing_members(backend: object) -> list[str]:
    """The contract's members ``backend`` lacks (a loader's result is checked with it)."""
    names = [n for n in ModelBackend.__annotations__] + [
        n for n, v in vars(ModelBackend).items() if callable(v) and not n.startswith("_")]
    return sorted(n for n in set(names) if not hasattr(backend, n))


__all__ = ["CAPABILITY_KEYS", "ModelBackend", "all_capabilities", "missing_members"]
