"""SAE fidelity: how well an attached SAE reconstructs the residual rows it reads.

Per request (``monitoring: {"fidelity": true, "sae_id"?, "layer"?}`` on chat and
completions → ``millm.sae_fidelity``, docs/api-v1.md) and per corpus (the ``fidelity``
experiment, ``experiments.fidelity``), from the same two engine parts:

- a fidelity monitor entry (``MonitorEntry.fidelity``) on every row of the generation,
  read ``pre_steering`` (the residual arriving at the hook, before the attachment's own
  steering): per row the SAE's L0, ``||x - x_hat||^2`` and ``||x||^2``, and per chunk the
  sum of ``x``. Over all rows read (``FidelityTotals``): L0 = mean L0; MSE =
  ``sum ||x - x_hat||^2 / (rows · d_in)``; explained variance = ``1 - sum ||x - x_hat||^2
  / sum ||x - mean x||^2`` (the denominator ``sum ||x||^2 - ||sum x||^2 / rows``);
- three teacher-forced, unsteered passes over the tokens read (a request's prompt and
  completion): clean, with the SAE's reconstruction spliced in at its hook
  (``SteeringEntry.splice="reconstruction"``) and with zeros there (``"zero"``); each
  pass's mean next-token loss from its ``prompt_logprobs`` gives loss recovered =
  ``(L_zero - L_spliced) / (L_zero - L_clean)``. A backend without ``splice`` reports
  ``loss_recovered: null`` and ``loss_recovered_unavailable`` saying why.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import SAENotAttached
from gpu_engine.api.monitoring import unpack_fidelity
from gpu_engine.api.protocol import (
    ActivationRecord,
    AttachmentStatus,
    ErrorEvent,
    FinishEvent,
    GenerationJob,
    MonitorEntry,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from inference.errors import OpenAIError
from inference.protocol_extensions import MonitoringRequest
from monitoring.services import take_records
from steering.selectors import attachment_choices

if TYPE_CHECKING:
    from core.engine_client import EngineClient
    from inference.outcomes import Outcome
    from inference.planning import Plan

FIDELITY_TAG = "fidelity"  # the monitor entries' tag: read apart from the request's own
READ_POINT = "pre_steering"
SPLICES = ("reconstruction", "zero")
VECTOR_LAYOUT = "vector"  # a raw steering vector: decoder rows only, nothing to reconstruct with


def fidelity_entry(sae_id: str, layer: int, positions: Any = "all") -> MonitorEntry:
    """The engine's fidelity monitor entry for one attachment (every row by default)."""
    return MonitorEntry(
        sae_id=sae_id, layer=layer, fidelity=True, positions=positions, read_point=READ_POINT, tag=FIDELITY_TAG
    )


def splice_spec(sae_id: str, layer: int, splice: str) -> SteeringSpec:
    """The steering of a spliced pass: the attachment's hook rows replaced by the SAE's
    reconstruction (``reconstruction``) or by zeros (``zero``), nothing else steered."""
    return SteeringSpec([SteeringEntry(sae_id=sae_id, layer=layer, splice=splice)])


def splice_unavailable(capabilities: Any, backend: str | None) -> str | None:
    """Why loss recovered cannot be measured on this backend (None: it can): the splice
    or the prompt's own log-probabilities are missing."""
    if capabilities is None:
        return "no model is loaded"
    if not getattr(capabilities, "splice", False):
        reason = getattr(capabilities, "splice_reason", None)
        return reason if isinstance(reason, str) and reason else f"the {backend} backend cannot splice an SAE in"
    if not getattr(capabilities, "prompt_logprobs", True):
        return f"the {backend} backend reports no prompt log-probabilities"
    return None


# --------------------------------------------------------------------------- figures


@dataclass
class FidelityTotals:
    """One attachment's fidelity sums over any number of records (requests, contexts),
    in float64; ``figures()`` reads them as L0, MSE and explained variance."""

    d_in: int
    rows: int = 0
    l0_sum: float = 0.0
    sq_err_sum: float = 0.0
    sq_norm_sum: float = 0.0
    x_sum: np.ndarray | None = None
    # the l0 of every row, kept when ``keep_l0`` (its distribution, for a corpus)
    l0_counts: dict[int, int] | None = None

    def add(self, record: ActivationRecord) -> None:
        stats = record.fidelity
        if stats is None:
            return
        l0, sq_err, sq_norm, x_sum = unpack_fidelity(stats)
        if x_sum.shape[0] != self.d_in:
            raise ValueError(f"a fidelity record's x_sum has {x_sum.shape[0]} values for d_in {self.d_in}")
        self.rows += int(stats.rows)
        self.l0_sum += float(l0.astype(np.float64).sum())
        self.sq_err_sum += float(sq_err.astype(np.float64).sum())
        self.sq_norm_sum += float(sq_norm.astype(np.float64).sum())
        xs = x_sum.astype(np.float64)
        self.x_sum = xs.copy() if self.x_sum is None else self.x_sum + xs
        if self.l0_counts is not None:
            values, counts = np.unique(l0, return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist()):
                self.l0_counts[v] = self.l0_counts.get(v, 0) + c

    def merge(self, other: FidelityTotals) -> None:
        self.rows += other.rows
        self.l0_sum += other.l0_sum
        self.sq_err_sum += other.sq_err_sum
        self.sq_norm_sum += other.sq_norm_sum
        if other.x_sum is not None:
            self.x_sum = other.x_sum.copy() if self.x_sum is None else self.x_sum + other.x_sum
        if self.l0_counts is not None and other.l0_counts is not None:
            for v, c in other.l0_counts.items():
                self.l0_counts[v] = self.l0_counts.get(v, 0) + c

    def figures(self) -> dict[str, Any]:
        """``rows``, ``l0`` (mean), ``mse`` and ``explained_variance`` (None where no row
        was read, or the rows do not vary)."""
        if not self.rows:
            return {"rows": 0, "l0": None, "mse": None, "explained_variance": None}
        centred = self.sq_norm_sum - float(np.dot(self.x_sum, self.x_sum)) / self.rows
        return {
            "rows": self.rows,
            "l0": self.l0_sum / self.rows,
            "mse": self.sq_err_sum / (self.rows * self.d_in),
            "explained_variance": _finite(1.0 - self.sq_err_sum / centred) if centred > 0 else None,
        }


def loss_recovered(clean: float | None, spliced: float | None, zero: float | None) -> float | None:
    """``(L_zero - L_spliced) / (L_zero - L_clean)``; None where a loss is missing or the
    zero-ablated loss equals the clean one (nothing to recover)."""
    if clean is None or spliced is None or zero is None or zero == clean:
        return None
    return _finite((zero - spliced) / (zero - clean))


def nll_sum(prompt_logprobs: Sequence[float | None] | None) -> tuple[float, int]:
    """The summed negative log-likelihood of a teacher-forced pass's tokens ``1..N-1``
    (token 0 has no prediction) and how many; ValueError where one is missing."""
    if prompt_logprobs is None:
        raise ValueError("the pass returned no prompt log-probabilities")
    values = list(prompt_logprobs)[1:]
    if any(v is None or not math.isfinite(v) for v in values):
        raise ValueError("the pass returned a missing or non-finite prompt log-probability")
    return -math.fsum(values), len(values)  # type: ignore[arg-type]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- per request


@dataclass(frozen=True)
class FidelityPlan:
    """What a request's ``monitoring.fidelity`` measures: these attachments, with loss
    recovered unless ``unavailable`` says why not."""

    attachments: tuple[AttachmentStatus, ...]
    unavailable: str | None = None
    context_length: int | None = None

    def monitor_entries(self) -> list[MonitorEntry]:
        return [fidelity_entry(a.sae_id, a.layer) for a in self.attachments]


def fidelity_plan(
    *, asked: MonitoringRequest, attachments: Sequence[AttachmentStatus], status: Any = None, backend: str | None = None
) -> FidelityPlan:
    """The attachments a request's ``monitoring`` names (every attached SAE with an
    encoder when it names none), or a refusal before anything runs: nothing attached, or
    nothing matching (400 ``sae_not_attached`` naming ``monitoring.sae_id`` or
    ``monitoring.layer``), a raw steering vector (400 ``invalid_parameter``: no encoder)."""
    if asked.sae_id is not None and not any(a.sae_id == asked.sae_id for a in attachments):
        param = "monitoring.sae_id"
    elif asked.layer is not None:
        param = "monitoring.layer"
    else:
        param = "monitoring.sae_id" if asked.sae_id is not None else "monitoring"
    matches = [
        a
        for a in attachments
        if (asked.sae_id is None or a.sae_id == asked.sae_id) and (asked.layer is None or a.layer == asked.layer)
    ]
    if not matches:
        named = " ".join(f"{k}={v!r}" for k, v in (("sae_id", asked.sae_id), ("layer", asked.layer)) if v is not None)
        where = f"attached: {', '.join(attachment_choices(attachments))}" if attachments else "none is attached"
        raise SAENotAttached(
            f"monitoring.fidelity: no attached SAE matches {named} ({where})"
            if named
            else "monitoring.fidelity needs an attached SAE; none is attached",
            details={"param": param, "choices": attachment_choices(attachments)},
        )
    encoders = [a for a in matches if a.layout != VECTOR_LAYOUT]
    if not encoders:
        raise OpenAIError(
            f"monitoring.fidelity: {', '.join(attachment_choices(matches))} is a raw steering vector, "
            "with no encoder to reconstruct the residual with",
            status=400,
            code="invalid_parameter",
            param=param,
        )
    capabilities = status.capabilities if status is not None else None
    return FidelityPlan(
        attachments=tuple(encoders),
        unavailable=splice_unavailable(capabilities, backend or (status.backend if status is not None else None)),
        context_length=status.context_length if status is not None else None,
    )


def fidelity_take_records(*, finish: FinishEvent, tokens: Sequence[Any] = ()) -> list[ActivationRecord]:
    """Remove the fidelity entries' records from a finished generation (the request's own
    ``return_sae_activations`` never sees them) and return them."""
    return take_records(lambda r: r.tag == FIDELITY_TAG and r.fidelity is not None, finish=finish, tokens=tokens)


@dataclass
class ChoiceFidelity:
    """One finished choice's fidelity: per attachment its sums, and the teacher-forced
    losses (summed negative log-likelihoods over ``tokens`` predicted tokens)."""

    totals: dict[tuple[str, int], FidelityTotals]
    tokens: int = 0
    clean: float | None = None
    spliced: dict[tuple[str, int], float] = field(default_factory=dict)
    zero: dict[tuple[str, int], float] = field(default_factory=dict)
    unavailable: str | None = None


async def measure_fidelity(plan: Plan, outcome: Outcome, client: EngineClient) -> None:
    """A finished choice's fidelity (``outcome.fidelity``): its fidelity records taken out
    and summed, then the three teacher-forced passes over its prompt and completion."""
    fp = plan.fidelity
    if fp is None:
        return
    records = fidelity_take_records(finish=outcome.finish, tokens=outcome.tokens)
    totals = {(a.sae_id, a.layer): FidelityTotals(int(a.d_in)) for a in fp.attachments}
    for r in records:
        t = totals.get((r.sae_id, r.layer))
        if t is not None:
            t.add(r)
    result = ChoiceFidelity(totals=totals, unavailable=fp.unavailable)
    outcome.fidelity = result
    if fp.unavailable is not None:
        return
    ids = [*outcome.finish.prompt_token_ids, *outcome.finish.token_ids]
    if fp.context_length is not None:
        ids = ids[: max(fp.context_length - 1, 0)]  # each pass generates one token after them
    if len(ids) < 2:
        result.unavailable = "fewer than 2 tokens were read: no next-token loss to measure"
        return
    job = outcome.choice.job
    passes = [("clean", None, SteeringSpec())]
    for a in fp.attachments:
        for splice in SPLICES:
            passes.append((splice, (a.sae_id, a.layer), splice_spec(a.sae_id, a.layer, splice)))
    try:
        sums = await asyncio.gather(
            *(_teacher_forced(client, ids, spec, job.priority, job.cache_namespace) for _, _, spec in passes)
        )
    except _PassFailed as exc:
        result.unavailable = str(exc)
        return
    (clean, n), *rest = sums
    result.tokens, result.clean = n, clean
    for (splice, key, _), (total, _) in zip(passes[1:], rest):
        (result.spliced if splice == "reconstruction" else result.zero)[key] = total


class _PassFailed(Exception):
    """A teacher-forced pass the engine refused or ended without a result."""


async def _teacher_forced(
    client: EngineClient, ids: list[int], steering: SteeringSpec, priority: str, namespace: str | None
) -> tuple[float, int]:
    """One teacher-forced pass over ``ids``: its summed next-token loss and token count."""
    job = GenerationJob(
        request_id=f"fidelity-{uuid.uuid4().hex}",
        prompt_token_ids=list(ids),
        add_special_tokens=False,
        sampling=SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True),
        steering=steering,
        priority=priority,
        cache_namespace=namespace,
    )
    async for event in client.agenerate(job):
        if isinstance(event, ErrorEvent):
            raise _PassFailed(f"a teacher-forced pass failed: {event.code}: {event.message}")
        if isinstance(event, FinishEvent):
            try:
                return nll_sum(event.prompt_logprobs)
            except ValueError as exc:
                raise _PassFailed(f"a teacher-forced pass failed: {exc}") from None
    raise _PassFailed("a teacher-forced pass ended without a result")


def fidelity_payload(plan: Plan, outcomes: Iterable[Outcome]) -> list[dict[str, Any]]:
    """``millm.sae_fidelity``: per attachment, its figures over every choice's rows, and
    loss recovered over every choice's tokens (null, with the reason, where unavailable)."""
    fp = plan.fidelity
    if fp is None:
        return []
    measured = [o.fidelity for o in outcomes if getattr(o, "fidelity", None) is not None]
    unavailable = next((m.unavailable for m in measured if m.unavailable is not None), None)
    if not measured:
        unavailable = fp.unavailable or "no choice finished"
    tokens = sum(m.tokens for m in measured)
    out = []
    for a in fp.attachments:
        key = (a.sae_id, a.layer)
        total = FidelityTotals(int(a.d_in))
        for m in measured:
            total.merge(m.totals[key])
        entry: dict[str, Any] = {"sae_id": a.sae_id, "layer": a.layer, "read_point": READ_POINT, **total.figures()}
        losses: dict[str, float | None] = {"clean": None, "spliced": None, "zero": None}
        if unavailable is None and tokens:
            losses = {
                "clean": math.fsum(m.clean or 0.0 for m in measured) / tokens,
                "spliced": math.fsum(m.spliced[key] for m in measured) / tokens,
                "zero": math.fsum(m.zero[key] for m in measured) / tokens,
            }
        recovered = loss_recovered(losses["clean"], losses["spliced"], losses["zero"])
        reason = unavailable
        if reason is None and recovered is None:
            reason = "the zero-ablated loss equals the clean loss: nothing to recover"
        entry.update(
            loss_tokens=tokens if unavailable is None else 0,
            loss_clean=losses["clean"],
            loss_spliced=losses["spliced"],
            loss_zero=losses["zero"],
            loss_recovered=recovered,
            loss_recovered_unavailable=reason,
        )
        out.append(entry)
    return out
