"""The hidden-states analyzer: chosen layers' rows at chosen positions, reduced (none,
mean, last or L2 norm), and the two numpy functions it reads them with."""

from __future__ import annotations

from typing import Any

import numpy as np

from .common import prompt_len, unknown_keys
from .registry import AnalysisContext, CaptureNeed, params_error


def reduce_hidden(rows: np.ndarray, how: str) -> Any:
    """``none``: the rows; ``mean``: their mean; ``last``: the last row; ``norm``: the L2
    norm of the layer's whole capture (mia's per-layer norm)."""
    rows = np.asarray(rows, dtype=np.float64)
    if how == "none":
        return rows
    if how == "mean":
        return rows.mean(axis=0)
    if how == "last":
        return rows[-1]
    return float(np.linalg.norm(rows))


def select_rows(positions: np.ndarray, mode: str, prompt_len: int) -> np.ndarray:
    """Indices of the captured rows that positions ``mode`` names, in a capture taken at
    that mode or at a wider one that holds it (``registry.covers``: a request's own
    capture and its analyzers' are united into one)."""
    pos = np.asarray(positions)
    if mode == "all" or not pos.size:
        return np.arange(pos.size)
    if mode == "prompt":
        mask = pos < prompt_len
    elif mode == "completion":
        mask = pos >= prompt_len - 1  # row P-1+i produced completion token i
    elif mode == "last_prompt":
        mask = pos == prompt_len - 1
    else:  # last: the last row computed
        mask = pos == pos.max()
    return np.nonzero(mask)[0]


class HiddenStates:
    name = "hidden_states"
    description = "hidden states of chosen layers, reduced: none, mean, last or L2 norm per layer"
    REDUCES = ("none", "mean", "last", "norm")

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"layers", "reduce", "positions"}, self.name)
        reduce = params.get("reduce", "none")
        if reduce not in self.REDUCES:
            raise params_error(self.name, f"reduce must be one of {self.REDUCES}")
        layers = params.get("layers")
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
        ):
            raise params_error(self.name, "layers must list decoder layers")
        positions = params.get("positions", "last" if reduce == "last" else "all")
        from ..api.protocol import CAPTURE_POSITIONS

        if positions not in CAPTURE_POSITIONS:
            raise params_error(self.name, f"positions must be one of {CAPTURE_POSITIONS}")
        return {"layers": sorted(set(layers)), "reduce": reduce, "positions": positions}

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return CaptureNeed(layers=tuple(p["layers"]), positions=p["positions"])

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        out = {}
        rows = select_rows(capture.positions, p["positions"], prompt_len(capture))
        for layer in p["layers"]:
            value = reduce_hidden(np.asarray(capture.hidden[layer])[rows], p["reduce"])
            out[str(layer)] = value.tolist() if isinstance(value, np.ndarray) else value
        return {"reduce": p["reduce"], "layers": out}
