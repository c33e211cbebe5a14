"""Hidden states and attention Q/K a request captures, and the artifact it gets back."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .errors import InvalidParameter
from .fields import Index, check_fields

CAPTURE_POSITIONS = ("last", "all", "prompt", "completion", "last_prompt")
CapturePositions = Literal[CAPTURE_POSITIONS]  # type: ignore[valid-type]


class AttentionCaptureSpec(msgspec.Struct):
    """Attention queries and keys to capture (``gpu_engine.interp.capture``), as the attention
    uses them: after the model's position encoding (rotary), per query head for Q and per
    KV head for K.

    ``heads``: query heads (``None``: all); K keeps the KV heads they read
    (``h // (num_heads // num_kv_heads)``).  ``positions``: K rows, ``q_positions`` Q rows
    (``None``: the same), in the modes of ``CaptureSpec.positions``.
    """

    _where = "capture.attention."

    layers: Annotated[list[Index], msgspec.Meta(min_length=1)]
    heads: Annotated[list[Index], msgspec.Meta(min_length=1)] | None = None  # None: all
    positions: CapturePositions = "prompt"
    q_positions: CapturePositions | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        self.layers = sorted(set(self.layers))
        if self.heads is not None:
            self.heads = sorted(set(self.heads))

    @property
    def query_positions(self) -> str:
        return self.q_positions if self.q_positions is not None else self.positions


class CaptureSpec(msgspec.Struct):
    """Hidden states (and attention Q/K) to capture for one request (``gpu_engine.interp.capture``).

    ``layers``: decoder blocks whose output is captured, after every steering on that
    block (what block ``layer + 1`` reads).  ``positions`` index residual rows as
    ``MonitorEntry`` does: ``prompt`` = rows ``0..P-1``, ``completion`` = the rows that
    produced each generated token (``P-1+i``), ``all`` = every row computed, ``last`` = the
    last row computed, ``last_prompt`` = row ``P-1`` (the prompt's last token).
    ``attention``: Q/K of chosen layers and heads (``AttentionCaptureSpec``); a spec asks
    for hidden states, attention or both.  ``max_bytes`` (0: no limit) refuses, before
    anything runs, a capture whose worst case is larger; an artifact of at most
    ``inline_max_bytes`` comes back in the ``FinishEvent``, a larger one is written under
    ``directory`` (inline when unset). ``store_max_bytes`` (None: no quota) is the room
    left under the directory's quota: a capture whose worst case could be stored and is
    larger is refused (``capture_store_full``) before anything runs.
    """

    _where = "capture."

    layers: list[Index] = msgspec.field(default_factory=list)
    positions: CapturePositions = "last"
    max_bytes: Index = 0
    inline_max_bytes: Index = 0
    directory: str | None = None
    store_max_bytes: int | None = None
    model: str = ""  # the name the sidecar records (the engine's model id when empty)
    attention: AttentionCaptureSpec | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.layers and self.attention is None:
            raise InvalidParameter(
                "capture.layers must list at least one layer (or give capture.attention)", param="capture.layers"
            )
        self.layers = sorted(set(self.layers))


class CaptureResult(msgspec.Struct):
    """A finished request's capture: the safetensors file's bytes (``data``, inline) or
    its file name under the spec's directory (``file``, stored), and its sidecar."""

    capture_id: str
    nbytes: int
    meta: dict[str, Any] = msgspec.field(default_factory=dict)
    data: bytes | None = None
    file: str | None = None


__all__ = ["CAPTURE_POSITIONS", "AttentionCaptureSpec", "CaptureResult", "CaptureSpec"]
