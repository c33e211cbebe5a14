"""What a request reads from its attachments' SAEs (monitoring), and the records it gets back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec
import numpy as np

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

    ``packed=True`` reports every non-zero feature of every row read, as CSR bytes
    (``PackedRows``): one record per encoded chunk of consecutive rows, all in the
    ``FinishEvent`` (a packed entry never streams, and takes neither ``top_k`` nor
    ``features``).  Meant for corpus-wide statistics (feature dashboards).

    ``fidelity=True`` reports how well the SAE reconstructs the rows read, not features:
    one ``FidelityStats`` record per encoded chunk of consecutive rows, all in the
    ``FinishEvent`` (a fidelity entry never streams and takes neither ``top_k``,
    ``features`` nor ``packed``).
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
    # every non-zero feature of each row, packed (``PackedRows``), instead of top_k/features
    packed: bool = False
    # how well the SAE reconstructs each row read (``FidelityStats``), instead of features
    fidelity: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.positions, Mapping):
            self.positions = PositionRange(**self.positions)
        check_fields(self)
        if self.fidelity:
            if self.top_k or self.features or self.packed:
                raise InvalidParameter(
                    "a fidelity monitor entry reports the SAE's reconstruction error, not features: "
                    "give neither top_k, features nor packed",
                    param="monitor.fidelity",
                )
            if self.stream:
                raise InvalidParameter(
                    "a fidelity monitor entry never streams: its records come at the end", param="monitor.fidelity"
                )
        elif self.packed:
            if self.top_k or self.features:
                raise InvalidParameter(
                    "a packed monitor entry reports every non-zero feature: give neither top_k nor features",
                    param="monitor",
                )
            if self.stream:
                raise InvalidParameter(
                    "a packed monitor entry never streams: its records come at the end", param="monitor"
                )
        elif not self.top_k and not self.features:
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


class PackedRows(msgspec.Struct):
    """Every non-zero activation of ``rows`` consecutive rows, as CSR: little-endian int32
    ``row_ptr`` (rows + 1 entries), int32 feature ``indices`` (ascending within a row) and
    float32 ``values`` (``unpack`` reads them as numpy arrays)."""

    rows: int
    row_ptr: bytes
    indices: bytes
    values: bytes


def unpack(p: PackedRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row_ptr, indices, values)`` of packed rows as numpy arrays (int32, int32,
    float32); row ``r``'s features are ``indices[row_ptr[r]:row_ptr[r + 1]]``."""
    row_ptr = np.frombuffer(p.row_ptr, dtype="<i4")
    indices = np.frombuffer(p.indices, dtype="<i4")
    values = np.frombuffer(p.values, dtype="<f4")
    if row_ptr.shape[0] != p.rows + 1 or indices.shape != values.shape or int(row_ptr[-1]) != indices.shape[0]:
        raise ValueError(
            f"packed rows do not agree: {p.rows} rows, {row_ptr.shape[0]} row pointers, "
            f"{indices.shape[0]} indices, {values.shape[0]} values"
        )
    return row_ptr, indices, values


class FidelityStats(msgspec.Struct):
    """How well the SAE reconstructs ``rows`` consecutive rows, with ``x`` the hooked
    residual row (float32) and ``x_hat = decode(encode(x))`` (``b_dec`` included), as
    little-endian bytes (``unpack_fidelity`` reads them as numpy arrays):

    - ``l0``: int32 per row, the number of non-zero features;
    - ``sq_err``: float32 per row, ``||x - x_hat||^2``;
    - ``sq_norm``: float32 per row, ``||x||^2``;
    - ``x_sum``: float32 ``[d_in]``, the sum of ``x`` over the rows.

    Over many records: L0 = mean ``l0``; MSE = ``sum(sq_err) / (rows * d_in)``; explained
    variance = ``1 - sum(sq_err) / (sum(sq_norm) - ||sum x||^2 / rows)``."""

    rows: int
    l0: bytes
    sq_err: bytes
    sq_norm: bytes
    x_sum: bytes


def unpack_fidelity(f: FidelityStats) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(l0, sq_err, sq_norm, x_sum)`` of a fidelity record as numpy arrays (int32
    ``[rows]``, float32 ``[rows]``, float32 ``[rows]``, float32 ``[d_in]``); ValueError
    where their sizes do not agree with ``rows``."""
    if f.rows < 1:
        raise ValueError(f"a fidelity record covers at least one row, not {f.rows}")
    for name in ("l0", "sq_err", "sq_norm"):
        if len(getattr(f, name)) != 4 * f.rows:
            raise ValueError(f"fidelity {name}: {len(getattr(f, name))} bytes for {f.rows} rows")
    if not f.x_sum or len(f.x_sum) % 4:
        raise ValueError(f"fidelity x_sum: {len(f.x_sum)} bytes is no float32 vector")
    return (
        np.frombuffer(f.l0, dtype="<i4"),
        np.frombuffer(f.sq_err, dtype="<f4"),
        np.frombuffer(f.sq_norm, dtype="<f4"),
        np.frombuffer(f.x_sum, dtype="<f4"),
    )


class ActivationRecord(msgspec.Struct):
    sae_id: str
    layer: int
    read_point: str
    position: int
    token_index: int | None = None  # completion token index, None for prompt-only rows
    top_k: list[FeatureActivation] = msgspec.field(default_factory=list)
    features: list[FeatureActivation] = msgspec.field(default_factory=list)
    tag: str = ""  # the entry's ``MonitorEntry.tag``
    # a packed entry's record: rows ``position .. position + packed.rows - 1``, every
    # non-zero feature (``top_k`` and ``features`` then stay empty, ``token_index`` None)
    packed: PackedRows | None = None
    # a fidelity entry's record: rows ``position .. position + fidelity.rows - 1``
    # (``top_k`` and ``features`` then stay empty, ``token_index`` None)
    fidelity: FidelityStats | None = None


__all__ = [
    "POSITION_KEYWORDS",
    "READ_POINTS",
    "ActivationRecord",
    "FeatureActivation",
    "FidelityStats",
    "MonitorEntry",
    "MonitorSpec",
    "PackedRows",
    "PositionRange",
    "Positions",
    "unpack",
    "unpack_fidelity",
]
