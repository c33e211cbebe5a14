"""Sweeps: prompts × steering variants × strengths, plus each prompt's unsteered DEFAULT,
run as one batched job on the engine (docs/experiments.md, "Sweeps").

Per prompt: the DEFAULT generation (explicitly unsteered), then the reference
teacher-forced pass over prompt + default continuation (unsteered: its distributions are
the reference, its prompt log-probabilities the default's log-likelihood); beside them,
from the start, every (variant, strength) point's generation (the /v1 job with the
variant's steering at that strength, the target feature monitored at every row before
and after the layer's steering); once the default's continuation is known, each point's
teacher-forced pass over it (steered: the KL), then the unsteered teacher-forced pass over
the point's own continuation (the steered text's log-likelihood under the unsteered model). A point is stored when all of it is known;
ordinals are the grid's: prompt ``p``'s default is ``p · (1 + V·S)``, its point of
variant ``v`` at strength ``s`` comes ``1 + v·S + s`` after it.

Where the loaded backend cannot give teacher-forced distributions (vLLM), every point's
KL is null and the run's ``result.kl_unavailable`` holds the backend's reason; likewise
``loglik_unavailable`` without prompt log-probabilities.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.errors import ModelNotLoaded, ValidationFailed
from experiments import grid
from experiments.context import RunContext
from experiments.grid import (
    MAX_PROMPTS,
    MAX_STRENGTHS,
    MAX_TOKENS,
    MAX_VARIANTS,
    UNSTEERED,
    PromptPlan,
    VariantPlan,
)
from gpu_engine.api.protocol import EngineStatus

__all__ = ["MAX_PROMPTS", "MAX_STRENGTHS", "MAX_TOKENS", "MAX_VARIANTS", "SweepPlan", "run_sweep", "sweep_check"]


@dataclass
class SweepPlan:
    spec: dict[str, Any]
    prompts: list[PromptPlan]
    variants: list[VariantPlan]
    strengths: list[float]
    max_tokens: int
    kl_reason: str | None  # why KL cannot be measured on the loaded backend (None: it can)
    loglik_reason: str | None

    @property
    def per_prompt(self) -> int:
        return 1 + len(self.variants) * len(self.strengths)

    @property
    def total(self) -> int:
        return len(self.prompts) * self.per_prompt

    def ordinal(self, prompt: int, variant: int | None = None, strength: int | None = None) -> int:
        base = prompt * self.per_prompt
        return base if variant is None else base + 1 + variant * len(self.strengths) + int(strength or 0)


def grid_size(*, prompts: int, variants: int, strengths: int) -> int:
    """The points of a sweep: each prompt's default and every (variant, strength) of it."""
    return prompts * (1 + variants * strengths)


def check_grid(total: int, what: str) -> None:
    cap = int(settings.EXPERIMENT_MAX_POINTS)
    if total > cap:
        raise ValidationFailed(
            f"{what} makes {total} points; at most {cap} (EXPERIMENT_MAX_POINTS)",
            details={
                "param": "prompts",
                "points": total,
                "max_points": cap,
                "fields": {"prompts": [f"{what} makes {total} points; at most {cap} (EXPERIMENT_MAX_POINTS)"]},
            },
        )


def engine_ready(status: EngineStatus) -> None:
    if status.state != "ready" or not status.model_id:
        raise ModelNotLoaded("No model is loaded: load one before running an experiment", details={"param": "model"})


def measurable(status: EngineStatus) -> tuple[str | None, str | None]:
    """Why KL and the log-likelihood cannot be measured on the loaded backend (None: they can)."""
    caps = status.capabilities
    backend = status.backend or "loaded"
    kl = None
    if caps is None or not caps.prompt_distributions:
        kl = (caps.prompt_distributions_reason if caps is not None else None) or (
            f"the {backend} backend does not give teacher-forced distributions (prompt_distributions)"
        )
    loglik = None
    if caps is None or not caps.prompt_logprobs:
        loglik = (getattr(caps, "prompt_logprobs_reason", None) if caps is not None else None) or (
            f"the {backend} backend does not give prompt log-probabilities"
        )
    return kl, loglik


def sweep_check(*, data: dict[str, Any], status: EngineStatus) -> SweepPlan:
    """Everything a sweep needs, checked before anything runs: the grid's size, every
    prompt (the /v1 request model), every variant at every strength (the steering
    resolver against the engine's attachments, the loaded backend's capabilities) and
    its target. Refusals name the field (``prompts``, ``variants[1].index``, ``strengths``)."""
    prompts, variants, strengths = list(data["prompts"]), list(data["variants"]), [float(s) for s in data["strengths"]]
    total = grid_size(prompts=len(prompts), variants=len(variants), strengths=len(strengths))
    check_grid(total, f"{len(prompts)} prompts × (1 + {len(variants)} variants × {len(strengths)} strengths)")
    engine_ready(status)
    max_tokens, temperature, seed = (
        int(data.get("max_tokens", 32)),
        float(data.get("temperature", 0.0)),
        data.get("seed"),
    )
    plans = grid.read_prompts(prompts, status=status, max_tokens=max_tokens, temperature=temperature, seed=seed)
    resolved = [grid.read_variant(i, v, strengths=strengths, status=status) for i, v in enumerate(variants)]
    kl, loglik = measurable(status)
    spec = {
        "prompts": prompts,
        "variants": variants,
        "strengths": strengths,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    }
    return SweepPlan(spec, plans, resolved, strengths, max_tokens, kl, loglik)


def live_prompts(status: EngineStatus, max_tokens: int, rows: int, per_prompt: int) -> int:
    """Prompts whose reference distributions are held at once: enough to keep the run's
    engine rows busy, within REFERENCE_BYTES."""
    vocab = int(status.vocab_size or 1)
    room = max(1, grid.REFERENCE_BYTES // max(1, max_tokens * vocab * 4))
    wanted = max(2, -(-rows // max(1, per_prompt - 1)))
    return max(1, min(room, wanted))


async def run_sweep(ctx: RunContext) -> dict[str, Any]:
    """The sweep of ``ctx.spec`` (see the module); its result once every point is stored."""
    plan = await ctx.db(sweep_check, data=ctx.spec, status=ctx.status)
    await ctx.set_total(plan.total)
    await ctx.set_result(
        backend=ctx.backend,
        model=ctx.status.model_id,
        kl_unavailable=plan.kl_reason,
        loglik_unavailable=plan.loglik_reason,
    )
    stored = {p["ordinal"]: p for p in await ctx.stored_points()}
    live = asyncio.Semaphore(live_prompts(ctx.status, plan.max_tokens, ctx.rows, plan.per_prompt))
    await asyncio.gather(*(_prompt(ctx, plan, prompt, stored, live) for prompt in plan.prompts))
    return {
        "points": plan.total,
        "prompts": len(plan.prompts),
        "variants": len(plan.variants),
        "strengths": plan.strengths,
        "backend": ctx.backend,
        "model": ctx.status.model_id,
        "kl_unavailable": plan.kl_reason,
        "loglik_unavailable": plan.loglik_reason,
    }


async def default_of(ctx: RunContext, prompt: PromptPlan, stored: dict[str, Any] | None) -> tuple[Any, list, list]:
    """The prompt's DEFAULT: (its generation's finish or None when stored, prompt ids,
    continuation ids)."""
    if stored is not None:
        return None, list(stored["data"]["prompt_token_ids"]), list(stored["token_ids"])
    finish = await ctx.generate(prompt.job(ctx.request_id(f"p{prompt.index}-default"), steering=UNSTEERED))
    return finish, list(finish.prompt_token_ids), list(finish.token_ids)


async def _prompt(
    ctx: RunContext, plan: SweepPlan, prompt: PromptPlan, stored: dict[int, dict[str, Any]], live: asyncio.Semaphore
) -> None:
    p = prompt.index
    missing = [
        (v, k)
        for v in range(len(plan.variants))
        for k in range(len(plan.strengths))
        if plan.ordinal(p, v, k) not in stored
    ]
    default_row = stored.get(plan.ordinal(p))
    if default_row is not None and not missing:
        return
    async with live:
        # the points' generations do not depend on the default: they start beside it, and
        # only their teacher-forced KL pass waits for the default's continuation
        reference: asyncio.Future = asyncio.get_running_loop().create_future()
        points = [asyncio.ensure_future(_point(ctx, plan, prompt, plan.variants[v], k, reference)) for v, k in missing]
        try:
            reference.set_result(await _default(ctx, plan, prompt, default_row))
        except BaseException as exc:
            reference.set_exception(exc)
            reference.exception()  # retrieved here: the points that await it raise it too
            for task in points:
                task.cancel()
            await asyncio.gather(*points, return_exceptions=True)
            raise
        await asyncio.gather(*points)


async def _default(
    ctx: RunContext, plan: SweepPlan, prompt: PromptPlan, default_row: dict[str, Any] | None
) -> tuple[list[int], list[int], Any]:
    """The prompt's DEFAULT, generated and stored unless stored already, and its reference
    teacher-forced pass: (prompt ids, default continuation, reference distributions or
    None when KL is not measured)."""
    p = prompt.index
    finish, prompt_ids, continuation = await default_of(ctx, prompt, default_row)
    kl_on = plan.kl_reason is None and bool(continuation)
    reference = None
    default_loglik = None
    if kl_on or (finish is not None and plan.loglik_reason is None and continuation):
        loglik_on = plan.loglik_reason is None
        tf = await grid.unsteered_pass(
            ctx, f"p{p}-reference", prompt_ids, continuation, distributions=kl_on, logprobs=loglik_on
        )
        if kl_on:
            reference = await ctx.off(grid.distributions_of, tf, len(continuation))
        if plan.loglik_reason is None:
            default_loglik = grid.loglik_of(tf, len(prompt_ids), len(continuation))
    if finish is not None:
        await ctx.store_points(
            [
                {
                    "ordinal": plan.ordinal(p),
                    "prompt_index": p,
                    "is_default": True,
                    "text": finish.text,
                    "token_ids": continuation,
                    "finish_reason": finish.finish_reason,
                    "loglik": None if default_loglik is None else float(sum(default_loglik)),
                    "loglik_per_token": default_loglik,
                    "data": {"prompt_token_ids": prompt_ids},
                }
            ]
        )
    return prompt_ids, continuation, reference


async def _point(
    ctx: RunContext,
    plan: SweepPlan,
    prompt: PromptPlan,
    variant: VariantPlan,
    k: int,
    default: asyncio.Future,
) -> None:
    p, v, strength = prompt.index, variant.index, plan.strengths[k]
    spec = variant.specs[k]
    tag = f"p{p}-v{v}-s{k}"
    generation = asyncio.ensure_future(
        ctx.generate(prompt.job(ctx.request_id(tag), steering=spec, monitor=variant.monitor))
    )
    try:
        prompt_ids, continuation, reference = await default
        kl = await grid.steered_kl(ctx, f"{tag}-kl", prompt_ids, continuation, spec, reference)
        finish = await generation
    finally:
        if not generation.done():
            generation.cancel()
            await asyncio.gather(generation, return_exceptions=True)
    tokens = list(finish.token_ids)
    loglik = None
    if plan.loglik_reason is None and tokens:
        tf = await grid.unsteered_pass(ctx, f"{tag}-loglik", prompt_ids, tokens, distributions=False, logprobs=True)
        loglik = grid.loglik_of(tf, len(prompt_ids), len(tokens))
    point: dict[str, Any] = {
        "ordinal": plan.ordinal(p, v, k),
        "prompt_index": p,
        "variant_index": v,
        "strength": strength,
        "text": finish.text,
        "token_ids": tokens,
        "finish_reason": finish.finish_reason,
        "kl_per_position": grid.finite(kl),
        "kl_mean": grid.mean(kl),
        "loglik_per_token": loglik,
        "loglik": None if loglik is None else float(sum(loglik)),
    }
    if variant.target is not None:
        reading = grid.target_reading(finish, variant.target)
        point.update(
            target_before_per_position=reading.before,
            target_after_per_position=reading.after,
            target_before=grid.steered_mean(reading.before, variant, len(prompt_ids)),
            target_after=grid.steered_mean(reading.after, variant, len(prompt_ids)),
        )
    await ctx.store_points([point])
