"""Calibration: the strength of one variant whose mean KL(steered ‖ default) over a set of
prompts meets a budget, found by bisection on the batched engine (docs/experiments.md,
"Calibration").

Each prompt's DEFAULT continuation is generated once (unsteered) and its reference
distributions computed by one unsteered teacher-forced pass; a strength is then measured
by one steered teacher-forced pass per prompt over the same continuation (no generation):
its mean KL is the mean over prompts of each prompt's mean over positions. The bounds
are measured first; where ``target_kl`` lies between their KLs, the bracket is halved
until a strength's KL is within ``tolerance`` of it or ``max_iterations`` midpoints were
measured (the closest measured strength is the answer, ``converged`` false). Every
measured strength is stored as one point per prompt (a resumed run measures no strength
twice) and listed in ``curve``.

With ``save_profile``, a converged strength is saved into the profile of that name
through steering's profile services (created bound to the variant's attachment, or the
feature's value set in an existing one bound there): an admin key's right, as every
profile write is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from django.db import transaction

from audit.services import audited, kwargs_of
from core.auth import Principal
from core.errors import Forbidden, MillmError
from experiments import grid
from experiments.context import RunContext
from experiments.errors import ExperimentUnavailable
from experiments.sweep import check_grid, default_of, engine_ready, measurable
from gpu_engine.api.protocol import EngineStatus

DEFAULT_BOUNDS = (0.0, 100.0)
# the reference distributions a calibration holds for all its prompts at once
REFERENCE_BYTES = 4 * grid.REFERENCE_BYTES


@dataclass
class CalibrationPlan:
    spec: dict[str, Any]
    prompts: list[grid.PromptPlan]
    total: int
    sae_id: str
    layer: int | None


def _variant(body: Any, strengths: list[float], status: EngineStatus) -> grid.VariantPlan:
    """The variant resolved at ``strengths``; a strength the resolver refuses is a
    bound's (``bounds``)."""
    try:
        return grid.read_variant(0, body, strengths=strengths, status=status, where="variant")
    except MillmError as exc:
        if exc.details.get("param") == "strengths":
            exc.details["param"] = "bounds"
            exc.details["fields"] = {"bounds": list((exc.details.get("fields") or {}).values())[0]}
            exc.message = exc.message.replace("strengths", "bounds")
        raise


def calibration_check(*, data: dict[str, Any], status: EngineStatus, principal: Principal) -> CalibrationPlan:
    """Everything a calibration needs, checked before anything runs (as a sweep's, and:
    the backend gives teacher-forced distributions, the bounds are ordered and valid
    strengths, the references fit, a profile save is an admin's and names a profile
    bound where the variant steers)."""
    prompts = list(data["prompts"])
    iterations = int(data.get("max_iterations", 12))
    total = len(prompts) * (1 + iterations + 2)
    check_grid(total, f"{len(prompts)} prompts × (1 default + {iterations} iterations + 2 bounds)")
    engine_ready(status)
    kl, _ = measurable(status)
    if kl is not None:
        raise ExperimentUnavailable(
            f"A calibration measures KL, and {kl}",
            details={"param": "target_kl", "backend": status.backend, "reason": kl},
        )
    bounds = [float(b) for b in (data.get("bounds") or DEFAULT_BOUNDS)]
    if not bounds[0] < bounds[1]:
        raise grid.refuse("bounds", "[low, high] with low below high")
    max_tokens = int(data.get("max_tokens", 32))
    vocab = int(status.vocab_size or 1)
    if len(prompts) * max_tokens * vocab * 4 > REFERENCE_BYTES:
        raise grid.refuse(
            "prompts",
            f"{len(prompts)} prompts × {max_tokens} tokens × a {vocab}-token vocabulary of reference "
            f"distributions exceed {REFERENCE_BYTES // 2**20} MiB: fewer prompts or max_tokens",
        )
    plans = grid.read_prompts(
        prompts,
        status=status,
        max_tokens=max_tokens,
        temperature=float(data.get("temperature", 0.0)),
        seed=data.get("seed"),
    )
    variant = _variant(data["variant"], bounds, status)
    entry = next((e for s in variant.specs for e in s.entries), None)
    profile = data.get("save_profile")
    if profile is not None:
        if not principal.admin:
            raise Forbidden(
                "save_profile writes a profile, which needs an admin key (MILLM_ADMIN_API_KEYS); "
                "calibrate without it and save the strength yourself",
                details={"param": "save_profile"},
            )
        if "vector" in data["variant"] or entry is None:
            raise grid.refuse("save_profile", "a profile holds SAE features: an inline vector cannot be saved")
        _check_profile(profile, entry.sae_id, entry.layer)
    spec = {
        "prompts": prompts,
        "variant": data["variant"],
        "target_kl": float(data["target_kl"]),
        "bounds": bounds,
        "tolerance": float(data.get("tolerance", 0.01)),
        "max_iterations": iterations,
        "max_tokens": max_tokens,
        "temperature": float(data.get("temperature", 0.0)),
        "seed": data.get("seed"),
        "save_profile": profile,
    }
    return CalibrationPlan(
        spec,
        plans,
        total,
        entry.sae_id if entry is not None else "",
        entry.layer if entry is not None else None,
    )


def _check_profile(name: str, sae_id: str, layer: int) -> None:
    from steering.models import Profile

    found = Profile.objects.filter(name=name).first()
    if found is not None and found.sae_id and (found.sae_id, found.layer) != (sae_id, layer):
        raise grid.refuse(
            "save_profile",
            f"profile {name!r} steers {found.sae_id} at layer {found.layer}, not {sae_id} at layer {layer}",
        )


async def run_calibration(ctx: RunContext) -> dict[str, Any]:
    """The calibration of ``ctx.spec`` (see the module); its result."""
    spec = ctx.spec
    plan = await ctx.db(calibration_check, data=spec, status=ctx.status, principal=Principal("server", "server", True))
    prompts = plan.prompts
    n = len(prompts)
    await ctx.set_total(plan.total)
    await ctx.set_result(backend=ctx.backend, model=ctx.status.model_id)
    stored = {p["ordinal"]: p for p in await ctx.stored_points()}

    async def reference(prompt: grid.PromptPlan) -> tuple[list[int], list[int], Any]:
        finish, prompt_ids, continuation = await default_of(ctx, prompt, stored.get(prompt.index))
        if finish is not None:
            await ctx.store_points(
                [
                    {
                        "ordinal": prompt.index,
                        "prompt_index": prompt.index,
                        "is_default": True,
                        "text": finish.text,
                        "token_ids": continuation,
                        "finish_reason": finish.finish_reason,
                        "data": {"prompt_token_ids": prompt_ids},
                    }
                ]
            )
        if not continuation:
            return prompt_ids, continuation, None
        tf = await grid.unsteered_pass(
            ctx, f"p{prompt.index}-reference", prompt_ids, continuation, distributions=True, logprobs=False
        )
        return prompt_ids, continuation, await ctx.off(grid.distributions_of, tf, len(continuation))

    references = await asyncio.gather(*(reference(p) for p in prompts))
    evaluations = 0

    async def measure(strength: float) -> float | None:
        """The mean KL at ``strength`` (one steered teacher-forced pass per prompt),
        stored as one point per prompt; taken from the points when a runner before this
        one measured it."""
        nonlocal evaluations
        e = evaluations
        evaluations += 1
        first = n + e * n
        done = [stored.get(first + p) for p in range(n)]
        if all(d is not None and d["strength"] == strength for d in done):
            return grid.mean([d["kl_mean"] for d in done if d["kl_mean"] is not None])
        variant = await ctx.db(_variant, body=spec["variant"], strengths=[strength], status=ctx.status)

        async def one(p: int) -> dict[str, Any]:
            prompt_ids, continuation, ref = references[p]
            kl = await grid.steered_kl(ctx, f"e{e}-p{p}", prompt_ids, continuation, variant.specs[0], ref)
            return {
                "ordinal": first + p,
                "prompt_index": p,
                "variant_index": 0,
                "strength": strength,
                "kl_per_position": grid.finite(kl),
                "kl_mean": grid.mean(kl),
                "data": {"evaluation": e},
            }

        points = await asyncio.gather(*(one(p) for p in range(n)))
        await ctx.store_points(points)
        return grid.mean([pt["kl_mean"] for pt in points if pt["kl_mean"] is not None])

    target, tolerance = float(spec["target_kl"]), float(spec["tolerance"])
    lo, hi = (float(b) for b in spec["bounds"])
    curve: dict[float, float | None] = {}
    for s in (lo, hi):
        curve[s] = await measure(s)
    f_lo, f_hi = curve[lo], curve[hi]
    iterations = 0
    converged = False
    reason = None
    if f_lo is None or f_hi is None:
        reason = "KL could not be measured at the bounds (no default continuation)"
    elif abs(f_lo - target) <= tolerance or abs(f_hi - target) <= tolerance:
        converged = True
    elif not min(f_lo, f_hi) <= target <= max(f_lo, f_hi):
        reason = (
            f"target_kl {target:g} is not between the KL at the bounds ({lo:g}: {f_lo:.6g}, {hi:g}: {f_hi:.6g}); "
            "widen the bounds"
        )
    else:
        increasing = f_hi > f_lo
        a, b = lo, hi
        while iterations < int(spec["max_iterations"]):
            mid = (a + b) / 2
            iterations += 1
            value = await measure(mid)
            curve[mid] = value
            if value is None:
                reason = "KL could not be measured"
                break
            if abs(value - target) <= tolerance:
                converged = True
                break
            if (value < target) == increasing:
                a = mid
            else:
                b = mid
        else:
            reason = f"no strength within tolerance {tolerance:g} after {iterations} iterations"
    measured = [(s, k) for s, k in curve.items() if k is not None]
    best = min(measured, key=lambda sk: (abs(sk[1] - target), abs(sk[0]))) if measured else (None, None)
    result: dict[str, Any] = {
        "strength": best[0],
        "kl": best[1],
        "converged": converged,
        "iterations": iterations,
        "target_kl": target,
        "tolerance": tolerance,
        "bounds": [lo, hi],
        "curve": [{"strength": s, "kl": k} for s, k in sorted(curve.items())],
        "reason": reason,
        "profile": None,
    }
    points = len(await ctx.stored_points())
    await ctx.set_total(points)
    if spec.get("save_profile") and converged and best[0] is not None:
        result["profile"] = await ctx.db(
            calibration_save,
            name=spec["save_profile"],
            body=spec["variant"],
            strength=float(best[0]),
            status=ctx.status,
            run_id=ctx.run_id,
            kl=float(best[1]),
        )
    return result


@audited(
    "experiment.calibration_save",
    lambda kw, r: ("profile", (r or {}).get("id", ""), kw.get("name", "")),
    params=kwargs_of("run_id", "strength", "kl"),
)
def calibration_save(
    *, name: str, body: dict[str, Any], strength: float, status: EngineStatus, run_id: str, kl: float
) -> dict[str, Any]:
    """Save the calibrated strength into the profile ``name`` (steering's profile
    services): created bound to the variant's attachment, or the feature's value (its
    control's, for a mode other than a plain add) replaced in the existing one."""
    from steering import services as steering
    from steering.models import Profile

    variant = grid.read_variant(0, body, strengths=[strength], status=status, where="variant")
    entry = variant.specs[0].entries[0]
    plain = dict(entry.features)
    controls = [_control(c) for c in entry.controls]
    index = int(body["index"])
    with transaction.atomic():
        found = Profile.objects.select_for_update().filter(name=name).first()
        if found is None:
            profile = steering.profile_create(
                name=name,
                steering={str(i): v for i, v in plain.items()},
                controls=controls,
                sae_id=entry.sae_id,
                layer=entry.layer,
                model_name=status.model_id or "",
                description=f"Calibrated by {run_id}: mean KL {kl:.6g}",
            )
        else:
            values = {k: v for k, v in (found.steering or {}).items() if int(k) != index}
            kept = [c for c in (found.controls or []) if int(c.get("index", -1)) != index]
            values.update({str(i): v for i, v in plain.items()})
            profile = steering.profile_update(
                profile=found,
                data={"steering": values, "controls": [*kept, *controls], "sae_id": entry.sae_id, "layer": entry.layer},
            )
    return {"id": profile.id, "name": profile.name}


def _control(c: Any) -> dict[str, Any]:
    from steering.rules import control_json

    return control_json(c)
