"""The analyzer registry: names, declared captures, and turning declarations into a
``CaptureSpec`` (for a request) or checking them against a stored artifact.

A deployment adds analyzers with ``ANALYZERS_EXTRA`` — dotted ``"pkg.module:register"``
entries, each a function called with the registry at start-up (``load_extra``); a
duplicate name is refused, as SAE formats are (STYLE §9).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..api.errors import AnalyzerCaptureMissing, InvalidParameter, UnknownAnalyzer
from ..api.protocol import AttentionCaptureSpec, CaptureSpec

# which positions modes hold the rows of which others (gpu_engine.interp.capture.rows_for):
# ``all`` holds every row; ``prompt`` holds row P-1; ``completion`` holds the last row
_COVERS = {
    "all": {"all", "prompt", "completion", "last", "last_prompt"},
    "prompt": {"prompt", "last_prompt"},
    "completion": {"completion", "last"},
    "last": {"last"},
    "last_prompt": {"last_prompt"},
}


def covers(have: str, need: str) -> bool:
    return need in _COVERS.get(have, ())


def merge_positions(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a or b
    if covers(a, b):
        return a
    if covers(b, a):
        return b
    return "all"


@dataclass(frozen=True)
class CaptureNeed:
    """What an analyzer reads: hidden states of ``layers`` at ``positions``; Q of
    ``heads`` (None: all) at ``q_positions`` and K at ``k_positions`` of ``qk_layers``."""

    layers: tuple[int, ...] = ()
    positions: str | None = None
    qk_layers: tuple[int, ...] = ()
    heads: tuple[int, ...] | None = None
    q_positions: str | None = None
    k_positions: str | None = None

    def merged(self, other: CaptureNeed) -> CaptureNeed:
        sides = [x for x in (self, other) if x.qk_layers]
        heads = None if any(x.heads is None for x in sides) else tuple(sorted(set().union(*(x.heads for x in sides))))  # type: ignore[arg-type]
        return CaptureNeed(
            layers=tuple(sorted(set(self.layers) | set(other.layers))),
            positions=merge_positions(self.positions, other.positions),
            qk_layers=tuple(sorted(set(self.qk_layers) | set(other.qk_layers))),
            heads=heads,
            q_positions=merge_positions(self.q_positions, other.q_positions),
            k_positions=merge_positions(self.k_positions, other.k_positions),
        )


@dataclass
class AnalysisContext:
    """What analyzers may read besides the capture: the directory probe files are named
    in (never a path from a request), and a way to load another capture by id (CoRe's
    N/A run)."""

    probe_dir: Path | None = None
    load_capture: Callable[[str], Any] | None = None


class Analyzer(Protocol):
    name: str
    description: str

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> Any:
        """Validated parameters (``InvalidParameter`` / ``InvalidProbeFile`` otherwise)."""

    def needs(self, prepared: Any) -> CaptureNeed: ...

    def run(self, capture: Any, prepared: Any, ctx: AnalysisContext) -> dict[str, Any]: ...


@dataclass
class AnalyzerRegistry:
    analyzers: dict[str, Analyzer] = field(default_factory=dict)

    def register(self, analyzer: Analyzer) -> None:
        name = getattr(analyzer, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"analyzer {analyzer!r} has no name")
        if name in self.analyzers:
            raise ValueError(f"analyzer {name!r} is registered already")
        for attr in ("prepare", "needs", "run"):
            if not callable(getattr(analyzer, attr, None)):
                raise ValueError(f"analyzer {name!r} has no {attr}()")
        self.analyzers[name] = analyzer

    def names(self) -> list[str]:
        return sorted(self.analyzers)

    def get(self, name: str) -> Analyzer:
        analyzer = self.analyzers.get(name)
        if analyzer is None:
            known = self.names()
            raise UnknownAnalyzer(
                f"unknown analyzer {name!r}; known analyzers: {', '.join(known)}",
                details={"param": "analyze", "analyzer": name, "known": known},
            )
        return analyzer


def load_extra(registry: AnalyzerRegistry, entries: Iterable[str]) -> None:
    """Call each ``"pkg.module:function"`` with the registry (``ANALYZERS_EXTRA``);
    ``ValueError`` naming the entry when it does not import or register."""
    for entry in entries:
        module_name, _, func_name = entry.strip().partition(":")
        if not module_name or not func_name:
            raise ValueError(f"{entry!r} is not of the form 'package.module:function'")
        try:
            func = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"{entry!r} cannot be imported: {exc}") from exc
        func(registry)


def capture_spec_for(need: CaptureNeed, base: CaptureSpec | None, **limits: Any) -> CaptureSpec:
    """The request's capture with what ``need`` declares added (layers and heads united,
    positions widened to a mode holding both)."""
    if base is not None:
        have = CaptureNeed(layers=tuple(base.layers), positions=base.positions if base.layers else None)
        att = base.attention
        if att is not None:
            have = CaptureNeed(
                layers=have.layers,
                positions=have.positions,
                qk_layers=tuple(att.layers),
                heads=tuple(att.heads) if att.heads is not None else None,
                q_positions=att.query_positions,
                k_positions=att.positions,
            )
        need = have.merged(need)
        limits = {
            "max_bytes": base.max_bytes,
            "inline_max_bytes": base.inline_max_bytes,
            "directory": base.directory,
            "model": base.model,
            **limits,
        }
    attention = None
    if need.qk_layers:
        k = need.k_positions or "prompt"
        q = need.q_positions or k
        attention = AttentionCaptureSpec(
            layers=list(need.qk_layers),
            heads=list(need.heads) if need.heads is not None else None,
            positions=k,
            q_positions=None if q == k else q,
        )
    return CaptureSpec(layers=list(need.layers), positions=need.positions or "last", attention=attention, **limits)


def check_capture(meta: dict[str, Any], need: CaptureNeed, analyzer: str) -> None:
    """``AnalyzerCaptureMissing`` unless the artifact described by ``meta`` holds what
    ``need`` declares."""
    missing: list[str] = []
    layers = set(meta.get("layers") or [])
    if need.layers:
        if not set(need.layers) <= layers:
            missing.append(f"hidden-state layers {sorted(set(need.layers) - layers)}")
        elif need.positions and not covers(str(meta.get("positions")), need.positions):
            missing.append(f"hidden-state positions {need.positions!r} (captured {meta.get('positions')!r})")
    if need.qk_layers:
        att = meta.get("attention")
        if not att:
            missing.append(f"attention Q/K of layers {list(need.qk_layers)}")
        else:
            if not set(need.qk_layers) <= set(att["layers"]):
                missing.append(f"attention layers {sorted(set(need.qk_layers) - set(att['layers']))}")
            heads = set(need.heads) if need.heads is not None else set(range(att["num_heads"]))
            if not heads <= set(att["heads"]):
                missing.append(f"attention heads {sorted(heads - set(att['heads']))}")
            if need.q_positions and not covers(att["q_positions"], need.q_positions):
                missing.append(f"Q positions {need.q_positions!r} (captured {att['q_positions']!r})")
            if need.k_positions and not covers(att["positions"], need.k_positions):
                missing.append(f"K positions {need.k_positions!r} (captured {att['positions']!r})")
    if missing:
        raise AnalyzerCaptureMissing(
            f"analyzer {analyzer!r} needs {'; '.join(missing)}, which the capture lacks",
            details={"param": "analyze", "analyzer": analyzer, "missing": missing},
        )


def params_error(analyzer: str, message: str) -> InvalidParameter:
    return InvalidParameter(f"analyzer {analyzer!r}: {message}", param="analyze.params", details={"analyzer": analyzer})


__all__ = [
    "AnalysisContext",
    "Analyzer",
    "AnalyzerRegistry",
    "CaptureNeed",
    "capture_spec_for",
    "check_capture",
    "covers",
    "load_extra",
    "merge_positions",
    "params_error",
]
