"""What a request reads from its attachments' SAEs (monitoring), and the records it gets back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from .errors import InvalidParameter
from .fields import MONITOR_TOP_K, AttachmentKey, Index, Name, PositionRange, check_fields

READ_POINTS = ("pre_steering", "post_steering")
POSITION_KEYWORDS = ("last", "prompt", "completion", "all")
Positions = Literal[POSITION_KEYWORDS] | PositionRange  # type: ignore[valid-type]


class MonitorEntry(msgspec.Struct):
    """What to read from one attachment.

    Positions index *residual rows* of the full sequence: rows ``0..P-1`` are the prompt;
    the completion token ``i`` is produced from row ``P-1+i`` and its record travels with
    that token.  ``completion`` = those rows, ``last`` = the last row computed, ``all`` =
    every row computed.  ``top_k`` features are the largest non-zero activations;
    ``features`` are always reported (zero included).

    ``stream=False`` (default): rows are encoded in one batch when the request ends and
    every record arrives in the ``FinishEvent`` (cheapest: the encoder is read once).
    ``stream=True``: each step is encoded as it runs and a completion row's record travels
    with its ``TokenEvent`` (``positions="last"`` is always delivered at the end).
    """

    _where = "monitor."

    sae_id: Name
    layer: Index
    top_k: Annotated[int, MONITOR_TOP_K.meta] = 0
    features: list[Index] = msgspec.field(default_factory=list)
    read_point: Literal[READ_POINTS] = "post_steering"  # type: ignore[valid-type]
    positions: Positions = "completion"
    stream: bool = False
    # who asked (``""``: the request itself): entries of the same attachment and read
    # point with different tags are read apart, and each record carries its entry's tag
    # (probes and sensing ride on monitors without colliding with the request's own)
    tag: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.positions, Mapping):
            self.positions = PositionRange(**self.positions)
        check_fields(self)
        if not self.top_k and not self.features:
            raise InvalidParameter("monitor entry asks for nothing: give top_k or features", param="monitor")

    @property
    def key(self) -> AttachmentKey:
        return (self.sae_id, self.layer)


class MonitorSpec(msgspec.Struct):
    entries: list[MonitorEntry] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[tuple[str, int, str, str]] = set()
        for e in self.entries:
            k = (e.sae_id, e.layer, e.read_point, e.tag)
            if k in seen:
                raise InvalidParameter(f"duplicate monitor entry for {k}", param="monitor")
            seen.add(k)


class FeatureActivation(msgspec.Struct):
    feature_index: int
    activation: float


class ActivationRecord(msgspec.Struct):
    sae_id: str
    layer: int
    read_point: str
    position: int
    token_index: int | None = None  # completion token index, None for prompt-only rows
    top_k: list[FeatureActivation] = msgspec.field(default_factory=list)
    features: list[FeatureActivation] = msgspec.field(default_factory=list)
    tag: str = ""  # the entry's ``MonitorEntry.tag``


__all__ = [
    "POSITION_KEYWORDS",
    "READ_POINTS",
    "ActivationRecord",
    "FeatureActivation",
    "MonitorEntry",
    "MonitorSpec",
    "PositionRange",
    "Positions",
]
