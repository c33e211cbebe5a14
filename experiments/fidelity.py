"""Corpus SAE fidelity: how well one attached SAE reconstructs the residual over a corpus
(docs/experiments.md, "SAE fidelity"), the ``fidelity`` kind of experiment.

The corpus is read exactly as a feature dashboard reads it (``features.corpus``): the
offline sample or a /v1 file of the caller's, tokenized by the loaded model, packed into
contexts of ``context_tokens`` up to ``token_budget`` tokens. Each context is one
unsteered, teacher-forced pass at batch priority with two monitor entries on every row
(``pre_steering``): a fidelity entry (per row L0, ``||x - x_hat||^2``, ``||x||^2``; the
sum of ``x``) and a packed one (which features fired: dead and dense features); its
``prompt_logprobs`` give the clean next-token loss. Two more passes over the same
context, with the SAE's reconstruction spliced in at its hook and with zeros there, give
the spliced and zero-ablated losses (where the backend cannot splice, the run's
``loss_recovered_unavailable`` says why and those stay null).

Contexts are measured ``group_contexts`` at a time; each group's sums are stored as one
point (``ExperimentPoint.data``, ordinal = the group's), so a cancelled run keeps the
groups done and a resumed one measures only the rest. The figures (``fidelity_figures``,
the run's ``result``) are read from the stored groups once all are in: L0 (mean and its
distribution), MSE, explained variance, the three losses and loss recovered, and the dead
(never fired) and dense (fired on more than ``dense_threshold`` of the rows) features.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
from django.conf import settings

from core.auth import Principal
from core.errors import ValidationFailed
from experiments.context import RunContext
from gpu_engine.api.monitoring import unpack
from gpu_engine.api.protocol import (
    EngineStatus,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)
from inference.fidelity import (
    READ_POINT,
    VECTOR_LAYOUT,
    FidelityTotals,
    fidelity_entry,
    loss_recovered,
    nll_sum,
    splice_spec,
    splice_unavailable,
)

__all__ = ["FidelityPlan", "fidelity_check", "fidelity_figures", "run_fidelity"]

GROUP_CONTEXTS = 16  # contexts per stored point
DENSE_THRESHOLD = 0.1  # a feature firing on more than this share of the rows is dense
TOKENIZE_TEXTS = 256  # texts per tokenize command
PACKED_TAG = "fidelity-fired"  # the packed entry's tag, apart from the fidelity entry's
# log10 density bins of the features that fired (the density histogram)
DENSITY_EDGES = [x / 2 for x in range(-16, 1)]


@dataclass
class FidelityPlan:
    spec: dict[str, Any]
    sae_id: str
    layer: int
    total: int  # the groups the budget allows (the corpus may hold fewer)


def _attachment(status: EngineStatus, sae_id: str, layer: int | None) -> Any:
    """The engine's attachment of the SAE (409 SAE_NOT_ATTACHED naming where it is), one
    with an encoder (a raw steering vector has nothing to reconstruct with: 422)."""
    from features.services import attached_layer

    attachment = attached_layer(sae_id=sae_id, layer=layer, attachments=list(status.attachments))
    if attachment.layout == VECTOR_LAYOUT:
        raise ValidationFailed(
            f"{sae_id} is a raw steering vector: it has no encoder to reconstruct the residual with",
            details={"param": "sae_id", "fields": {"sae_id": ["a raw steering vector has no encoder"]}},
        )
    return attachment


def fidelity_check(*, data: dict[str, Any], status: EngineStatus, principal: Principal) -> FidelityPlan:
    """Everything a corpus fidelity run needs, checked before it is queued: a model is
    loaded, the SAE exists (404) and is attached with an encoder (409 naming the layers it
    is attached at), the budget fits DASHBOARD_MAX_TOKENS, a context fits the model's
    window, and a file corpus is the caller's (404 naming file_id) and text (400
    INVALID_CORPUS). ``data`` as ``FidelityStartInput`` validated it."""
    from experiments.sweep import engine_ready
    from registry.selectors import sae_get

    sae_id = str(data["sae_id"])
    sae_get(sae_id=sae_id)
    engine_ready(status)
    attachment = _attachment(status, sae_id, data.get("layer"))
    budget, context_tokens = int(data["token_budget"]), int(data.get("context_tokens", 64))
    cap = int(settings.DASHBOARD_MAX_TOKENS)
    if not 1 <= budget <= cap:
        raise ValidationFailed(
            f"token_budget must be between 1 and {cap} (DASHBOARD_MAX_TOKENS); got {budget}",
            details={"param": "token_budget", "fields": {"token_budget": [f"at most {cap}"]}},
        )
    window = int(status.context_length or 0)
    if window and context_tokens >= window:
        raise ValidationFailed(
            f"context_tokens must be below the model's context window ({window})",
            details={"param": "context_tokens", "fields": {"context_tokens": [f"at most {window - 1}"]}},
        )
    corpus = str(data.get("corpus", "sample"))
    text_field = str(data.get("text_field") or "text")
    spec: dict[str, Any] = {
        "sae_id": sae_id,
        "layer": int(attachment.layer),
        "corpus": corpus,
        "token_budget": budget,
        "context_tokens": context_tokens,
        "dense_threshold": float(data.get("dense_threshold", DENSE_THRESHOLD)),
        "group_contexts": GROUP_CONTEXTS,
    }
    if corpus == "file":
        spec.update(file_id=str(data["file_id"]), text_field=text_field)
        from features.services import check_corpus_file  # as a dashboard run checks it

        check_corpus_file(file_id=spec["file_id"], text_field=text_field, principal=principal)
    contexts = -(-budget // context_tokens)
    return FidelityPlan(spec, sae_id, int(attachment.layer), -(-contexts // GROUP_CONTEXTS))


# --------------------------------------------------------------------------- the corpus


async def read_contexts(ctx: RunContext) -> list[list[int]]:
    """The run's contexts: the corpus tokenized at the engine, a few hundred texts at a
    time until the budget is covered, packed by ``features.corpus.pack_contexts``.
    The same corpus, model and budget give the same contexts (a resumed run's)."""
    from features.corpus import CorpusError, pack_contexts
    from features.services import corpus_error, corpus_texts
    from gpu_engine.api.jobs import MAX_TOKENIZE_CHARS

    spec = ctx.spec
    budget = int(spec["token_budget"])
    # the corpus's documents, as a dashboard run reads them (the owner's file as its owner)
    documents = corpus_texts(
        corpus=spec["corpus"],
        file_id=spec.get("file_id", ""),
        text_field=spec.get("text_field") or "text",
        owner=ctx.owner,
    )

    def next_texts() -> list[str]:
        # on the run's database thread: a file corpus is read from the database
        return [t[:MAX_TOKENIZE_CHARS] for t in islice(documents, TOKENIZE_TEXTS)]

    token_lists: list[list[int]] = []
    try:
        seen = 0
        while seen < budget:
            texts = await ctx.db(next_texts)
            if not texts:
                break
            for ids in await ctx.tokenize(texts):
                token_lists.append(ids)
                seen += len(ids)
    except CorpusError as exc:
        raise corpus_error(exc, default_param="file_id") from None
    contexts = pack_contexts(token_lists, context_tokens=int(spec["context_tokens"]), budget=budget)
    if not contexts:
        raise corpus_error(
            CorpusError("corpus_empty", "The corpus has no text to read (no context of 2 tokens or more)", "corpus")
        )
    return contexts


# --------------------------------------------------------------------------- one group


def _jobs(ctx: RunContext, ids: list[int], splice: bool) -> list[GenerationJob]:
    """A context's passes: the clean one with its two monitor entries, then (where the
    backend splices) the spliced and zero-ablated ones; all unsteered otherwise."""
    sae_id, layer = ctx.spec["sae_id"], int(ctx.spec["layer"])
    sampling = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True)
    monitor = MonitorSpec(
        [
            fidelity_entry(sae_id, layer, positions="prompt"),
            MonitorEntry(
                sae_id=sae_id, layer=layer, packed=True, positions="prompt", read_point=READ_POINT, tag=PACKED_TAG
            ),
        ]
    )
    common: dict[str, Any] = {"prompt_token_ids": ids, "add_special_tokens": False, "sampling": sampling}
    jobs = [
        GenerationJob(
            request_id=ctx.request_id("clean"), monitor=monitor, steering=SteeringSpec(), priority="batch", **common
        )
    ]
    if splice:
        for name in ("reconstruction", "zero"):
            jobs.append(
                GenerationJob(
                    request_id=ctx.request_id(name),
                    steering=splice_spec(sae_id, layer, name),
                    priority="batch",
                    **common,
                )
            )
    return jobs


async def _group(ctx: RunContext, contexts: Sequence[list[int]], d_in: int, d_sae: int, splice: bool) -> dict:
    """One group's sums (a point's ``data``)."""
    sae_id, layer = ctx.spec["sae_id"], int(ctx.spec["layer"])
    finishes = await asyncio.gather(*(ctx.generate(j) for ids in contexts for j in _jobs(ctx, ids, splice)))
    per = 3 if splice else 1

    def summed() -> dict[str, Any]:
        totals = FidelityTotals(d_in, l0_counts={})
        fired = np.zeros(d_sae, dtype=np.int64)
        nll = {"clean": 0.0, "spliced": 0.0, "zero": 0.0}
        tokens = 0
        for i in range(len(contexts)):
            clean, *spliced = finishes[i * per : (i + 1) * per]
            for r in clean.activations:
                if r.sae_id != sae_id or r.layer != layer:
                    continue
                if r.fidelity is not None:
                    totals.add(r)
                elif r.packed is not None and r.tag == PACKED_TAG:
                    _, indices, _ = unpack(r.packed)
                    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= d_sae):
                        raise ValueError(f"a packed record names a feature outside d_sae {d_sae}")
                    fired += np.bincount(indices, minlength=d_sae)
            total, n = nll_sum(clean.prompt_logprobs)
            nll["clean"] += total
            tokens += n
            for name, finish in zip(("spliced", "zero"), spliced):
                nll[name] += nll_sum(finish.prompt_logprobs)[0]
        nz = np.flatnonzero(fired)
        return {
            "contexts": len(contexts),
            "tokens": sum(len(c) for c in contexts),
            "rows": totals.rows,
            "l0_sum": totals.l0_sum,
            "sq_err_sum": totals.sq_err_sum,
            "sq_norm_sum": totals.sq_norm_sum,
            "x_sum": [] if totals.x_sum is None else totals.x_sum.tolist(),
            "l0_counts": {str(k): v for k, v in sorted((totals.l0_counts or {}).items())},
            "loss_tokens": tokens,
            "nll_clean": nll["clean"],
            "nll_spliced": nll["spliced"] if splice else None,
            "nll_zero": nll["zero"] if splice else None,
            "fired": {"indices": nz.tolist(), "counts": fired[nz].tolist()},
        }

    return await ctx.off(summed)


# --------------------------------------------------------------------------- the figures


def fidelity_figures(
    groups: Sequence[dict[str, Any]], *, d_in: int, d_sae: int, dense_threshold: float, unavailable: str | None
) -> dict[str, Any]:
    """The corpus figures from the stored groups' sums (see the module)."""
    totals = FidelityTotals(d_in, l0_counts={})
    fired = np.zeros(d_sae, dtype=np.int64)
    tokens = loss_tokens = 0
    nll: dict[str, float | None] = {"clean": 0.0, "spliced": 0.0, "zero": 0.0}  # None: a group lacks it
    for g in groups:
        part = FidelityTotals(
            d_in,
            rows=int(g["rows"]),
            l0_sum=float(g["l0_sum"]),
            sq_err_sum=float(g["sq_err_sum"]),
            sq_norm_sum=float(g["sq_norm_sum"]),
            x_sum=np.asarray(g["x_sum"], dtype=np.float64) if g["x_sum"] else None,
            l0_counts={int(k): int(v) for k, v in g["l0_counts"].items()},
        )
        totals.merge(part)
        fired[np.asarray(g["fired"]["indices"], dtype=np.int64)] += np.asarray(g["fired"]["counts"], dtype=np.int64)
        tokens += int(g["tokens"])
        loss_tokens += int(g["loss_tokens"])
        for name in nll:
            value = g.get(f"nll_{name}")
            so_far = nll[name]
            nll[name] = so_far + float(value) if value is not None and so_far is not None else None
    losses = {name: (v / loss_tokens if v is not None and loss_tokens else None) for name, v in nll.items()}
    if unavailable is not None:
        losses["spliced"] = losses["zero"] = None
    recovered = loss_recovered(losses["clean"], losses["spliced"], losses["zero"])
    reason = unavailable
    if reason is None and recovered is None:
        reason = "the zero-ablated loss equals the clean loss: nothing to recover"
    rows = totals.rows
    density = fired / rows if rows else np.zeros(d_sae)
    dead = np.flatnonzero(fired == 0)
    dense = np.flatnonzero(density > dense_threshold)
    alive = density[density > 0]
    hist, _ = (
        np.histogram(np.log10(alive), bins=DENSITY_EDGES) if alive.size else (np.zeros(len(DENSITY_EDGES) - 1), None)
    )
    l0_values = sorted((totals.l0_counts or {}).items())
    return {
        **totals.figures(),
        "tokens": tokens,
        "contexts": sum(int(g["contexts"]) for g in groups),
        "d_in": d_in,
        "d_sae": d_sae,
        "l0_distribution": {"l0": [k for k, _ in l0_values], "rows": [v for _, v in l0_values]},
        "loss_tokens": loss_tokens,
        "loss_clean": losses["clean"],
        "loss_spliced": losses["spliced"],
        "loss_zero": losses["zero"],
        "loss_recovered": recovered,
        "loss_recovered_unavailable": reason,
        "dead_count": int(dead.size),
        "dead_features": dead.tolist(),
        "dense_threshold": dense_threshold,
        "dense_count": int(dense.size),
        "dense_features": dense.tolist(),
        "density_histogram": {"log10_edges": DENSITY_EDGES, "counts": [int(c) for c in hist]},
    }


# --------------------------------------------------------------------------- the run


async def run_fidelity(ctx: RunContext) -> dict[str, Any]:
    """The corpus fidelity of ``ctx.spec`` (see the module); its figures once every group
    is stored."""
    spec = ctx.spec
    attachment = _attachment(ctx.status, spec["sae_id"], int(spec["layer"]))
    d_in, d_sae = int(attachment.d_in), int(attachment.d_sae)
    unavailable = splice_unavailable(ctx.capabilities, ctx.backend)
    await ctx.set_result(
        backend=ctx.backend,
        model=ctx.status.model_id,
        sae_id=spec["sae_id"],
        layer=int(spec["layer"]),
        loss_recovered_unavailable=unavailable,
    )
    contexts = await read_contexts(ctx)
    size = int(spec.get("group_contexts") or GROUP_CONTEXTS)
    groups = [contexts[i : i + size] for i in range(0, len(contexts), size)]
    await ctx.set_total(len(groups))
    done = {int(p["ordinal"]) for p in await ctx.stored_points()}
    # two groups at the engine at once: the next one's passes fill the rows the last
    # passes of the one before leave free
    window = asyncio.Semaphore(2)

    async def measure(ordinal: int) -> None:
        async with window:
            data = await _group(ctx, groups[ordinal], d_in, d_sae, unavailable is None)
            await ctx.store_points([{"ordinal": ordinal, "prompt_index": ordinal, "data": data}])

    await asyncio.gather(*(measure(g) for g in range(len(groups)) if g not in done))
    stored = [p["data"] for p in await ctx.stored_points()]
    figures = await ctx.off(
        lambda: fidelity_figures(
            stored,
            d_in=d_in,
            d_sae=d_sae,
            dense_threshold=float(spec.get("dense_threshold", DENSE_THRESHOLD)),
            unavailable=unavailable,
        )
    )
    return {
        "backend": ctx.backend,
        "model": ctx.status.model_id,
        "sae_id": spec["sae_id"],
        "layer": int(spec["layer"]),
        **figures,
    }
