"""What the engine needs from a backend (transformers now; llama.cpp and vLLM later).

The engine owns policy (queueing, validation, attachments, drain, OOM recovery); a
backend owns the weights and forward passes.  Steering and monitoring reach a backend
only as a ``HookManager`` whose hooks it must call on the residual stream after a decoder
block, publishing a ``BatchContext`` (rows → request) around each forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..hooks import HookManager, RequestHooks
from ..inspect import ModelInfo
from ..protocol import EmbedJob, EmbedResult, FinishEvent, SamplingParams, ScoreJob, ScoreResult


@runtime_checkable
class Backend(Protocol):
    name: str
    info: ModelInfo
    device: Any
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int

    def block(self, layer: int) -> tuple[Any, str]:
        """The hookable module after decoder block ``layer`` and its path."""

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def encode_messages(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any) -> list[int]: ...

    def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        hook_manager: HookManager,
        request_hooks: RequestHooks | None,
        should_stop: Callable[[], bool],
        emit: Callable[[object], None],
    ) -> FinishEvent: ...

    def embed(self, job: EmbedJob, inputs: Sequence[list[int]]) -> EmbedResult: ...

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult: ...

    def close(self) -> None: ...


__all__ = ["Backend"]
