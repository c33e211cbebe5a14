"""One choice of a /v1 generation request, run and finished: its engine job, then what
becomes of its result before the answer is built — the monitoring history, the capture's
row, the analyzers, the probes' verdicts and sensing. The JSON body is shaped in
``inference.shaping``, a stream's frames in ``inference.streaming``; ``inference.serving``
strings them together."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from core.engine_client import EngineClient
from core.runtime import runtime
from gpu_engine.api.protocol import ErrorEvent, FinishEvent, TokenEvent, Usage
from inference.activations import reported_features
from inference.errors import OpenAIError, openai_error_event
from inference.planning import Choice, Plan, off_view_thread
from monitoring.probe_requests import (
    ProbePlan,
    probe_record,
    probe_score_hidden,
    probe_score_sae,
    probe_take_records,
    verdicts_header,
)
from monitoring.sensing import sensing_publish, sensing_take_records
from monitoring.services import capture_register, monitoring_record, monitoring_take_records
from registry.labels import labels_for


@dataclass
class Outcome:
    """One finished choice."""

    choice: Choice
    finish: FinishEvent
    tokens: list[TokenEvent]
    capture: dict[str, Any] | None = None  # millm.capture (register_capture)
    analysis: list[dict[str, Any]] | None = None  # millm.analysis (run_analyses)
    probes: list[dict[str, Any]] | None = None  # millm.probes (score_probes)
    labels: dict[int, str] | None = None  # millm.sae_activations' labels (label_activations)
    fidelity: Any = None  # millm.sae_fidelity's sums (inference.fidelity.measure_fidelity)


async def record_monitoring(plan: Plan, outcome: Outcome) -> None:
    """Hand /api/monitoring's records of a finished choice to the monitoring history
    (taken out of the outcome, so return_sae_activations never sees them)."""
    if plan.monitoring is None:
        return
    records = monitoring_take_records(entry=plan.monitoring, finish=outcome.finish, tokens=outcome.tokens)
    await off_view_thread(monitoring_record)(
        request_id=plan.history_id, entry=plan.monitoring, records=records, owner=plan.scope.owner
    )


async def label_activations(plan: Plan, outcome: Outcome) -> None:
    """The labels of the features ``millm.sae_activations`` will name (one query, off the
    event loop; ``registry.labels``)."""
    if plan.monitor is None or plan.attachment is None:
        return
    records = [*outcome.finish.activations, *(r for t in outcome.tokens for r in t.activations)]
    indices = reported_features(records, plan.attachment)
    outcome.labels = await off_view_thread(labels_for)(plan.attachment.sae_id, indices) if indices else {}


async def register_capture(plan: Plan, outcome: Outcome) -> None:
    """``millm.capture`` of a finished choice: the artifact inline (base64), or the
    ``Capture`` row of one the engine stored, fetched by id from /api/captures."""
    result = outcome.finish.capture
    if result is None:
        return
    if result.data is not None:
        outcome.capture = {
            "id": result.capture_id,
            "inline": True,
            "format": "safetensors",
            "bytes": result.nbytes,
            "data": base64.b64encode(result.data).decode(),
            "metadata": result.meta,
        }
        return
    await off_view_thread(capture_register)(request_id=plan.history_id, result=result, owner=plan.scope.owner)
    outcome.capture = {
        "id": result.capture_id,
        "inline": False,
        "format": "safetensors",
        "bytes": result.nbytes,
        "url": f"/api/captures/{result.capture_id}/download",
    }


async def run_analyses(plan: Plan, outcome: Outcome) -> None:
    """``millm.analysis`` of a finished choice: each analyzer of ``analyze`` on the
    capture it armed, where analyses run (``monitoring.analysis``: the process's pool
    embedded, the Celery analysis queue distributed; off the event loop and the engine's
    decode loop; after ``register_capture``, which stores the row of a stored capture)."""
    if not plan.analyses:
        return
    result = outcome.finish.capture
    source: Any = None
    if result is not None:
        if result.data is not None:
            source = result.data
        else:
            source = Path(outcome.choice.job.capture.directory or "") / (result.file or "")
    entries = await runtime().analyzers.arun(
        plan.analyses, source, capture_id=result.capture_id if result is not None else None
    )
    if result is not None and result.data is None:
        # stored: /api/captures/{id}/analyze can run another analyzer on it later
        entries = [{**e, "capture_id": result.capture_id} for e in entries]
    outcome.analysis = entries


async def probe_verdicts(probes: ProbePlan, outcome: Outcome, *, rows: str = "completion") -> list[dict[str, Any]]:
    """The verdicts of a finished choice (``monitoring.probe_requests``): SAE-feature probes from
    the records their monitors made (taken out first, so ``return_sae_activations`` never
    sees them), hidden-state probes from the capture in the analysis pool. ``rows``: the
    rows the monitors and capture were asked for (a generation's ``completion`` rows, a
    scoring pass's ``prompt`` rows). After ``register_capture``."""
    index = outcome.choice.index
    records = probe_take_records(finish=outcome.finish, tokens=outcome.tokens)
    verdicts = [h.skipped(r, index) for h, r in zip(probes.skipped, probes.reasons)]
    verdicts += probe_score_sae(
        heads=[h for h in probes.heads if h.basis == "sae_features"], records=records, choice=index
    )
    if probes.hidden:
        result = outcome.finish.capture
        source: Any = None
        if result is not None:
            source = (
                result.data
                if result.data is not None
                else Path(outcome.choice.job.capture.directory or "") / (result.file or "")
            )
        verdicts += await runtime().analyzers.acall(probe_score_hidden, probes.hidden, source, index, rows)
    order = {h.id: i for i, h in enumerate([*probes.skipped, *probes.heads])}
    return sorted(verdicts, key=lambda v: order.get(v["probe_id"], 0))


async def score_probes(plan: Plan, outcome: Outcome) -> None:
    """``millm.probes`` of a finished choice (``probe_verdicts``); then the verdicts go to
    the probe history."""
    if plan.probes is None:
        return
    outcome.probes = await probe_verdicts(plan.probes, outcome)
    await off_view_thread(probe_record)(request_id=plan.history_id, verdicts=outcome.probes, owner=plan.scope.owner)


def sense(plan: Plan, outcome: Outcome) -> None:
    """Sensing of a finished choice (``monitoring.sensing``): its records taken out of the
    outcome (``return_sae_activations`` never sees them), then one ``sensing:*`` event per
    watched document that fired. Nothing in the response changes."""
    if plan.sensing is None:
        return
    records = sensing_take_records(finish=outcome.finish, tokens=outcome.tokens)
    sensing_publish(
        plan=plan.sensing,
        records=records,
        request_id=plan.history_id,
        choice=outcome.choice.index,
        owner=plan.scope.owner,
    )


def probe_headers(plan: Plan, outcomes: list[Outcome]) -> dict[str, str]:
    if plan.probes is None or not outcomes or not outcomes[0].probes:
        return {}
    return {"X-miLLM-Probe-Verdicts": verdicts_header(outcomes[0].probes)}


def prompt_only(choice: Choice, finish: FinishEvent, tokens: list[TokenEvent]) -> Outcome:
    """A ``max_tokens: 0`` choice's outcome: the prompt read (its echo, logprobs and
    activations) and nothing generated — the one token the engine's prefill produced is
    dropped, and the monitor rows that travelled with it stay as prompt rows."""
    records = [
        msgspec.structs.replace(r, token_index=None)
        for r in [*finish.activations, *(r for t in tokens for r in t.activations)]
    ]
    n = finish.usage.prompt_tokens
    return Outcome(
        choice,
        msgspec.structs.replace(
            finish, finish_reason="length", text="", token_ids=[], tokens=[], usage=Usage(n, 0, n), activations=records
        ),
        [],
    )


def outcome_of(choice: Choice, finish: FinishEvent, tokens: list[TokenEvent]) -> Outcome:
    return prompt_only(choice, finish, tokens) if choice.prompt_only else Outcome(choice, finish, tokens)


async def run_choice(client: EngineClient, choice: Choice) -> Outcome:
    tokens: list[TokenEvent] = []
    async for event in client.agenerate(choice.job):
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, FinishEvent):
            return outcome_of(choice, event, tokens)
        elif isinstance(event, ErrorEvent):
            raise openai_error_event(event.code, event.message, event.details)
    raise OpenAIError(
        "the generation ended without a result", status=500, code="generation_failed", type="server_error"
    )
