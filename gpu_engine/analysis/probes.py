"""The analyzers that apply a probe file from ANALYZER_PROBE_DIR to hidden states: the
H-Node probe (.npz: standardised logistic regression on the last hidden state at its
layer) and the science-hallucination probe (JSON or .npz: a linear probe on the mean
completion hidden state). A probe is named by file name only, read without unpickling
(an .npz is checked by its headers before it inflates) and refused with
INVALID_PROBE_FILE when it does not hold what the analyzer needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..api.errors import InvalidProbeFile
from .common import prompt_len, unknown_keys
from .registry import AnalysisContext, CaptureNeed, params_error

# what a probe .npz under ANALYZER_PROBE_DIR may inflate to (a probe is a few vectors)
PROBE_NPZ_MAX_BYTES = 64 << 20


def sigmoid(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    return np.where(z >= 0, 1.0 / (1.0 + np.exp(-np.abs(z))), np.exp(-np.abs(z)) / (1.0 + np.exp(-np.abs(z))))


def _probe_path(ctx: AnalysisContext, name: Any, analyzer: str, suffixes: tuple[str, ...]) -> Path:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise params_error(analyzer, "probe must name a file in the probe directory (ANALYZER_PROBE_DIR)")
    if ctx.probe_dir is None:
        raise params_error(analyzer, "no probe directory is configured (ANALYZER_PROBE_DIR)")
    if not name.endswith(suffixes):
        raise InvalidProbeFile(
            f"probe {name!r} must be a {' or '.join(suffixes)} file",
            details={"param": "analyze.params.probe", "probe": name},
        )
    path = Path(ctx.probe_dir) / name
    if not path.is_file():
        raise InvalidProbeFile(
            f"probe {name!r} does not exist in the probe directory",
            details={"param": "analyze.params.probe", "probe": name},
        )
    return path


def _vector(data: Any, key: str, probe: str, size: int | None = None) -> np.ndarray:
    try:
        v = np.asarray(data[key], dtype=np.float64).reshape(-1)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidProbeFile(
            f"probe {probe!r}: {key} is missing or not numeric",
            details={"param": "analyze.params.probe", "probe": probe, "key": key},
        ) from exc
    if (size is not None and v.size != size) or not np.isfinite(v).all():
        raise InvalidProbeFile(
            f"probe {probe!r}: {key} has {v.size} finite values, expected {size}",
            details={"param": "analyze.params.probe", "probe": probe, "key": key},
        )
    return v


def _load_npz(path: Path, probe: str) -> dict[str, np.ndarray]:
    from ..api.archives import ArchiveRefused, read_npz

    try:  # checked by its headers before inflating; never unpickled
        return read_npz(path, max_bytes=PROBE_NPZ_MAX_BYTES)
    except ArchiveRefused as exc:
        raise InvalidProbeFile(
            f"probe {probe!r} is not a readable .npz file: {exc.message}",
            details={"param": "analyze.params.probe", "probe": probe, **exc.details},
        ) from exc


def _threshold(params: dict[str, Any], analyzer: str, default: float = 0.5) -> float:
    t = params.get("threshold", default)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
        raise params_error(analyzer, "threshold must be a probability in [0, 1]")
    return float(t)


@dataclass
class HNodeProbe:
    best_layer: int
    weights: np.ndarray
    bias: float
    scaler_mean: np.ndarray
    scaler_scale: np.ndarray
    h_node_indices: np.ndarray
    h_node_baselines: np.ndarray

    @classmethod
    def load(cls, path: Path, probe: str) -> HNodeProbe:
        data = _load_npz(path, probe)
        try:
            best_layer = int(np.asarray(data["best_layer"]).reshape(-1)[0])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InvalidProbeFile(
                f"probe {probe!r}: best_layer is missing", details={"param": "analyze.params.probe", "probe": probe}
            ) from exc
        w = _vector(data, "weights", probe)
        idx = _vector(data, "h_node_indices", probe)
        if (idx < 0).any() or (idx >= w.size).any() or (idx != np.round(idx)).any():
            raise InvalidProbeFile(
                f"probe {probe!r}: h_node_indices must index the hidden state",
                details={"param": "analyze.params.probe", "probe": probe},
            )
        return cls(
            best_layer,
            w,
            float(_vector(data, "bias", probe, 1)[0]),
            _vector(data, "scaler_mean", probe, w.size),
            _vector(data, "scaler_scale", probe, w.size),
            idx.astype(np.int64),
            _vector(data, "h_node_baselines", probe, idx.size),
        )


def hnode_score(h: np.ndarray, probe: HNodeProbe) -> dict[str, float]:
    """Standardised logistic regression: margin = ((h − mean) / scale) · w + b,
    probability = σ(margin); ``h_node_excess`` = mean over H-Nodes of max(0, h_j − baseline_j)
    (a zero scale counts as 1, as StandardScaler leaves constant features)."""
    h = np.asarray(h, dtype=np.float64)
    scale = np.where(probe.scaler_scale == 0, 1.0, probe.scaler_scale)
    margin = float(((h - probe.scaler_mean) / scale) @ probe.weights + probe.bias)
    excess = np.maximum(0.0, h[probe.h_node_indices] - probe.h_node_baselines)
    return {
        "probability": float(sigmoid(margin)),
        "margin": margin,
        "h_node_excess": float(excess.mean()) if excess.size else 0.0,
    }


class HNodeHallucination:
    name = "hnode_hallucination"
    description = "H-Node probe (.npz): standardised logistic regression on the last hidden state at its layer"

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"probe", "threshold"}, self.name)
        probe = params.get("probe")
        path = _probe_path(ctx, probe, self.name, (".npz",))
        return {"probe": HNodeProbe.load(path, probe), "name": probe, "threshold": _threshold(params, self.name)}

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return CaptureNeed(layers=(p["probe"].best_layer,), positions="last")

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        probe = p["probe"]
        h = np.asarray(capture.hidden[probe.best_layer])[-1]
        if h.shape[0] != probe.weights.size:
            raise InvalidProbeFile(
                f"probe {p['name']!r} has {probe.weights.size} weights; the hidden state has {h.shape[0]}",
                details={"param": "analyze.params.probe", "probe": p["name"]},
            )
        score = hnode_score(h, probe)
        return {
            **score,
            "verdict": "hallucinated" if score["probability"] >= p["threshold"] else "grounded",
            "best_layer": probe.best_layer,
            "threshold": p["threshold"],
            "n_h_nodes": int(probe.h_node_indices.size),
        }


class ScienceHallucination:
    name = "science_hallucination"
    description = "linear probe (JSON or .npz: layer, weights, bias) on the mean completion hidden state"

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"probe", "threshold"}, self.name)
        name = params.get("probe")
        path = _probe_path(ctx, name, self.name, (".json", ".npz"))
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidProbeFile(
                    f"probe {name!r} is not readable JSON: {exc}",
                    details={"param": "analyze.params.probe", "probe": name},
                ) from exc
            if not isinstance(data, dict):
                raise InvalidProbeFile(
                    f"probe {name!r} must be a JSON object", details={"param": "analyze.params.probe", "probe": name}
                )
        else:
            data = _load_npz(path, name)
        w = _vector(data, "weights", name)
        try:
            layer = int(np.asarray(data["layer"]).reshape(-1)[0])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InvalidProbeFile(
                f"probe {name!r}: layer is missing", details={"param": "analyze.params.probe", "probe": name}
            ) from exc
        return {
            "name": name,
            "layer": layer,
            "weights": w,
            "bias": float(_vector(data, "bias", name, 1)[0]),
            "threshold": _threshold(params, self.name),
        }

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return CaptureNeed(layers=(p["layer"],), positions="completion")

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        n = prompt_len(capture)
        rows = np.asarray(capture.hidden[p["layer"]], dtype=np.float64)
        pos = np.asarray(capture.positions)
        rows = rows[pos >= n - 1]  # the rows that produced completion tokens
        if rows.shape[-1] != p["weights"].size:
            raise InvalidProbeFile(
                f"probe {p['name']!r} has {p['weights'].size} weights; the hidden state has {rows.shape[-1]}",
                details={"param": "analyze.params.probe", "probe": p["name"]},
            )
        if not rows.shape[0]:
            raise params_error(self.name, "the capture holds no completion rows")
        margin = float(rows.mean(axis=0) @ p["weights"] + p["bias"])
        prob = float(sigmoid(margin))
        return {
            "probability": prob,
            "margin": margin,
            "layer": p["layer"],
            "threshold": p["threshold"],
            "verdict": "hallucinated" if prob >= p["threshold"] else "grounded",
        }
