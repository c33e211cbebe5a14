"""The analyzers that read attention Q/K: Attention Tracker (prompt injection), CoRe
(document reranking against an N/A-query run) and AttnLink-U (schema linking), as the
original (mia) defines them, with their shared parameter and capture readers.

Their conventions:

- token spans are half-open ``[start, end)`` indices into the prompt's tokens; a
  negative index counts from the prompt's end (Python slicing, as mia's Attention
  Tracker configs write ``(-5 - data_len, -5)``);
- ``layer_heads`` maps a layer to its query heads (``{"12": [3, 7]}``, mia's
  ``layer_to_heads``); query head ``h`` reads KV head ``h // (heads // kv_heads)``;
- attention is ``softmax(q · Kᵀ · scale)`` with the scale the model's attention applies
  at that layer (recorded in the capture's sidecar), in float64.

Each analyzer's math is a plain numpy function of arrays (``tracker_head_score``,
``query_attention``, ``core_document_scores``, ``attnlink_select``) so the tests can
check it on crafted tensors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .common import prompt_len, unknown_keys
from .registry import AnalysisContext, CaptureNeed, check_capture, params_error

EPS = 1e-8

# --------------------------------------------------------------------------- math


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def tracker_head_score(
    q: np.ndarray,
    keys: np.ndarray,
    scale: float,
    instruction: tuple[int, int],
    data: tuple[int, int],
    attn_func: str = "sum_normalize",
) -> float:
    """One head's Attention Tracker score: attention of the last token's ``q`` (d,) over
    the prompt's ``keys`` (P, d), its mass on the instruction span ÷ (instruction + data
    mass + 1e-8) (``sum_normalize``; ``max`` takes the span's peak instead of its sum)."""
    a = softmax(keys.astype(np.float64) @ q.astype(np.float64) * scale)
    inst, dat = a[slice(*instruction)], a[slice(*data)]
    score = inst.max() if attn_func.startswith("max") else inst.sum()
    if attn_func.endswith("normalize"):
        score = score / (inst.sum() + dat.sum() + EPS)
    return float(score)


def query_attention(q: np.ndarray, keys: np.ndarray, q_pos: np.ndarray, scale: float) -> np.ndarray:
    """Causal attention of queries ``q`` (n, d) at positions ``q_pos`` over ``keys`` (P, d)
    at positions 0..P-1, averaged over the queries → (P,)."""
    s = q.astype(np.float64) @ keys.astype(np.float64).T * scale
    s = np.where(np.arange(keys.shape[0])[None, :] <= q_pos[:, None], s, -np.inf)
    return softmax(s, axis=-1).mean(axis=0)


def core_document_scores(tok: np.ndarray, tok_na: np.ndarray, documents: list[tuple[int, int]]) -> list[float]:
    """CoRe's calibrated document scores: per document, the token scores minus the N/A
    run's, tokens below mean − 2·std of that difference dropped, the rest summed."""
    out = []
    for start, end in documents:
        cal = tok[start:end] - tok_na[start:end]
        keep = cal > cal.mean() - 2 * (cal.std(ddof=1) if cal.size > 1 else 0.0)
        out.append(float((cal * keep).sum()))
    return out


def attnlink_select(scores: list[float], temperature: float, top_p: float) -> dict[str, Any]:
    """AttnLink-U's candidate normalisation: softmax(log(score + 1e-8) / T) and the
    shortest ranked prefix whose probability reaches ``top_p`` (all at top_p = 1)."""
    logits = np.log(np.asarray(scores, dtype=np.float64) + EPS)
    probs = softmax((logits - logits.max()) / temperature)
    ranking = sorted(range(len(scores)), key=lambda i: -scores[i])
    selected, total = [], 0.0
    for i in ranking:
        selected.append(i)
        total += float(probs[i])
        if top_p < 1 and total >= top_p:
            break
    return {"probabilities": [float(p) for p in probs], "ranking": ranking, "selected": selected}


# --------------------------------------------------------------------------- params and capture


def _span(name: str, value: Any, analyzer: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise params_error(analyzer, f"{name} must be a [start, end) pair of token indices")
    return int(value[0]), int(value[1])


def _resolve(span: tuple[int, int], n: int, name: str, analyzer: str) -> tuple[int, int]:
    start, end = (v + n if v < 0 else v for v in span)
    if not 0 <= start < end <= n:
        raise params_error(analyzer, f"{name} {list(span)} is not a non-empty span of the {n}-token prompt")
    return start, end


def _layer_heads(value: Any, analyzer: str, *, one: bool = False) -> dict[int, list[int]]:
    if not isinstance(value, dict) or not value:
        raise params_error(analyzer, 'layer_heads must map layers to lists of query heads, e.g. {"2": [0, 1]}')
    out: dict[int, list[int]] = {}
    for k, heads in value.items():
        try:
            layer = int(k)
        except (TypeError, ValueError):
            raise params_error(analyzer, f"layer_heads key {k!r} is not a layer") from None
        if (
            layer < 0
            or not isinstance(heads, list)
            or not heads
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads)
        ):
            raise params_error(analyzer, f"layer_heads[{k!r}] must be a non-empty list of head indices")
        out[layer] = sorted(set(heads))
    if one and (len(out) != 1 or len(next(iter(out.values()))) != 1):
        raise params_error(analyzer, "needs exactly one layer and one head")
    return out


def _qk_need(layer_heads: dict[int, list[int]], q_positions: str) -> CaptureNeed:
    heads = sorted({h for hs in layer_heads.values() for h in hs})
    return CaptureNeed(
        qk_layers=tuple(sorted(layer_heads)), heads=tuple(heads), q_positions=q_positions, k_positions="prompt"
    )


def _row(positions: Any, position: int) -> int:
    hits = np.nonzero(np.asarray(positions) == position)[0]
    if not hits.size:
        raise params_error("capture", f"the capture has no row at position {position}")
    return int(hits[0])


def _head_q_k(capture: Any, layer: int, head: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Layer ``layer``'s Q rows of query ``head`` (rows, d), its KV head's prompt keys
    (P, d), and the attention's scale."""
    att = capture.attention
    group = att["num_heads"] // att["num_kv_heads"]
    q = np.asarray(capture.q[layer])[:, att["heads"].index(head)]
    k = np.asarray(capture.k[layer])[:, att["kv_heads"].index(head // group)]
    n = prompt_len(capture)
    k_pos = np.asarray(capture.k_positions)
    if k_pos.size < n or list(k_pos[:n]) != list(range(n)):
        raise params_error("capture", "the capture does not hold the keys of every prompt token")
    scale = att["scaling"].get(str(layer))
    return q, k[:n], float(scale) if scale is not None else 1.0 / math.sqrt(att["head_dim"])


# --------------------------------------------------------------------------- analyzers


class AttentionTracker:
    name = "attention_tracker"
    description = (
        "prompt-injection score: the last prompt token's attention to the instruction span "
        "over instruction + data, averaged over heads (lower: likely injection)"
    )

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"layer_heads", "instruction", "data", "attn_func"}, self.name)
        attn_func = params.get("attn_func", "sum_normalize")
        if attn_func not in ("sum", "sum_normalize", "max", "max_normalize"):
            raise params_error(self.name, "attn_func must be sum, sum_normalize, max or max_normalize")
        return {
            "layer_heads": _layer_heads(params.get("layer_heads"), self.name),
            "instruction": _span("instruction", params.get("instruction"), self.name),
            "data": _span("data", params.get("data"), self.name),
            "attn_func": attn_func,
        }

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return _qk_need(p["layer_heads"], "last_prompt")

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        n = prompt_len(capture)
        inst = _resolve(p["instruction"], n, "instruction", self.name)
        data = _resolve(p["data"], n, "data", self.name)
        heads = []
        for layer, hs in p["layer_heads"].items():
            for h in hs:
                q, k, scale = _head_q_k(capture, layer, h)
                qi = q[_row(capture.q_positions, n - 1)]
                heads.append(
                    {"layer": layer, "head": h, "score": tracker_head_score(qi, k, scale, inst, data, p["attn_func"])}
                )
        return {
            "score": float(np.mean([x["score"] for x in heads])),
            "heads": heads,
            "instruction": list(inst),
            "data": list(data),
            "attn_func": p["attn_func"],
        }


class CoReReranker:
    name = "core_reranker"
    description = (
        "document relevance: attention from the query tokens to each document's tokens at chosen "
        "layers/heads, calibrated against an N/A-query run (na_capture)"
    )

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"layer_heads", "documents", "query", "na_capture", "na_query"}, self.name)
        docs = params.get("documents")
        if not isinstance(docs, list) or not docs:
            raise params_error(self.name, "documents must list [start, end) token spans")
        na = params.get("na_capture")
        if not isinstance(na, str) or not na:
            raise params_error(self.name, "na_capture must name the capture of the run with the 'N/A' query")
        return {
            "layer_heads": _layer_heads(params.get("layer_heads"), self.name),
            "documents": [_span(f"documents[{i}]", d, self.name) for i, d in enumerate(docs)],
            "query": _span("query", params.get("query"), self.name),
            "na_query": _span("na_query", params.get("na_query"), self.name),
            "na_capture": na,
        }

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return _qk_need(p["layer_heads"], "prompt")

    def token_scores(self, capture: Any, p: dict[str, Any], query: tuple[int, int]) -> np.ndarray:
        n = prompt_len(capture)
        start, end = _resolve(query, n, "query", self.name)
        total = np.zeros(n)
        for layer, hs in p["layer_heads"].items():
            for h in hs:
                q, k, scale = _head_q_k(capture, layer, h)
                rows = [_row(capture.q_positions, pos) for pos in range(start, end)]
                total += query_attention(q[rows], k, np.arange(start, end), scale)
        return total

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        if ctx.load_capture is None:
            raise params_error(self.name, "no way to load the N/A run's capture here")
        na = ctx.load_capture(p["na_capture"])
        check_capture(na.meta, self.needs(p), self.name)
        tok = self.token_scores(capture, p, p["query"])
        tok_na = self.token_scores(na, p, p["na_query"])
        n = min(tok.size, tok_na.size)
        docs = [_resolve(d, n, f"documents[{i}]", self.name) for i, d in enumerate(p["documents"])]
        scores = core_document_scores(tok, tok_na, docs)
        ranking = sorted(range(len(scores)), key=lambda i: -scores[i])
        return {
            "scores": scores,
            "ranking": ranking,
            "sorted_scores": [scores[i] for i in ranking],
            "documents": [list(d) for d in docs],
        }


class AttnLinkU:
    name = "attnlink"
    description = "AttnLink-U: ranks schema items (prompt spans) by one generation-anchor head's attention"

    def prepare(self, params: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        unknown_keys(params, {"layer_heads", "candidates", "candidate_spans", "temperature", "top_p"}, self.name)
        spans = params.get("candidate_spans")
        cands = params.get("candidates")
        if not isinstance(spans, list) or not spans:
            raise params_error(self.name, "candidate_spans must list [start, end) token spans")
        if cands is None:
            cands = [str(i) for i in range(len(spans))]
        if not isinstance(cands, list) or len(cands) != len(spans) or len(set(map(str, cands))) != len(cands):
            raise params_error(self.name, "candidates must be unique, one per candidate span")
        t, top_p = params.get("temperature", 1.0), params.get("top_p", 0.8)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise params_error(self.name, "temperature must be finite and positive")
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise params_error(self.name, "top_p must be in (0, 1]")
        return {
            "layer_heads": _layer_heads(params.get("layer_heads"), self.name, one=True),
            "candidates": cands,
            "spans": [_span(f"candidate_spans[{i}]", s, self.name) for i, s in enumerate(spans)],
            "temperature": float(t),
            "top_p": float(top_p),
        }

    def needs(self, p: dict[str, Any]) -> CaptureNeed:
        return _qk_need(p["layer_heads"], "last_prompt")

    def run(self, capture: Any, p: dict[str, Any], ctx: AnalysisContext) -> dict[str, Any]:
        ((layer, (head,)),) = p["layer_heads"].items()
        n = prompt_len(capture)
        q, k, scale = _head_q_k(capture, layer, head)
        a = softmax(k.astype(np.float64) @ q[_row(capture.q_positions, n - 1)].astype(np.float64) * scale)
        spans = [_resolve(s, n, f"candidate_spans[{i}]", self.name) for i, s in enumerate(p["spans"])]
        scores = [float(a[s:e].mean()) for s, e in spans]
        return {
            "candidates": p["candidates"],
            "scores": scores,
            "layer": layer,
            "head": head,
            **attnlink_select(scores, p["temperature"], p["top_p"]),
        }
