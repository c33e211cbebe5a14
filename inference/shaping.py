"""The JSON body of an answered /v1 generation request, built from its finished choices
(``inference.outcomes.Outcome``): the choices in OpenAI's shapes (``inference.wire``), the
usage, and the ``millm`` object of the extensions. Also the token counters, advanced once
per answered request."""

from __future__ import annotations

from typing import Any

from core.metrics import record_speculative, record_tokens
from gpu_engine.api.protocol import FinishEvent, SteeringCount, TokenLogprob, to_builtins
from inference import wire
from inference.activations import activations_payload
from inference.fidelity import fidelity_payload
from inference.outcomes import Outcome
from inference.planning import Plan
from inference.protocol import CompletionRequest
from inference.tools import parse_tool_calls, tool_content
from inference.usage import request_ended


def top_dict(lp: TokenLogprob) -> dict[str, float]:
    # OpenAI's legacy shape; like vLLM, the chosen token is always among them
    top = {t.token: t.logprob for t in lp.top_logprobs}
    top.setdefault(lp.token, lp.logprob)
    return top


def _sum_counts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    totals: dict[tuple[str, int], SteeringCount] = {}
    for out in outcomes:
        for c in out.finish.steering_apply_count:
            total = totals.setdefault((c.sae_id, c.layer), SteeringCount(c.sae_id, c.layer, 0))
            total.count += c.count
            for mode, n in c.modes.items():
                total.modes[mode] = total.modes.get(mode, 0) + n
    return to_builtins(list(totals.values()))


def _fired(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Where each choice's conditional controls fired: row positions, and the completion
    tokens those rows produced (row ``P - 1 + i`` produces token ``i``)."""
    out: list[dict[str, Any]] = []
    for o in outcomes:
        last_prompt_row = len(o.finish.prompt_token_ids) - 1
        for f in o.finish.steering_fired:
            out.append(
                {
                    "choice": o.choice.index,
                    "sae_id": f.sae_id,
                    "layer": f.layer,
                    "index": f.index,
                    "mode": f.mode,
                    "positions": list(f.positions),
                    "token_indices": [p - last_prompt_row for p in f.positions if p >= last_prompt_row],
                }
            )
    return out


def _speculative(outcomes: list[Outcome]) -> dict[str, Any] | None:
    """SPECULATIVE_MODEL's figures over the request's choices: the drafts proposed and
    accepted, or why the request decoded without them."""
    stats = [o.finish.speculative for o in outcomes if o.finish.speculative is not None]
    if not stats:
        return None
    used = [s for s in stats if s.used]
    drafted, accepted = sum(s.drafted for s in used), sum(s.accepted for s in used)
    out: dict[str, Any] = {
        "used": bool(used),
        "source": stats[0].source,
        "num_tokens": stats[0].num_tokens,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }
    if not used:
        out["reason"] = stats[0].reason
    return out


def wants_millm(plan: Plan, outcomes: list[Outcome]) -> bool:
    """The response carries the ``millm`` object: the request used an extension, or the
    model decodes speculatively (its acceptance figures)."""
    return plan.wants_millm or any(o.finish.speculative is not None for o in outcomes)


def millm_object(plan: Plan, outcomes: list[Outcome]) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "steering": plan.steering.summary(),
        "steering_apply_count": _sum_counts(outcomes),
        "forward_passes": sum(o.finish.forward_passes for o in outcomes),
    }
    speculative = _speculative(outcomes)
    if speculative is not None:
        obj["speculative"] = speculative
    fired = _fired(outcomes)
    if fired:
        obj["steering_fired"] = fired
    if outcomes and outcomes[0].capture is not None and plan.request.capture is not None:
        # the capture the request asked for; one its analyzers alone armed is not sent
        obj["capture"] = outcomes[0].capture
    if outcomes and outcomes[0].analysis is not None:
        obj["analysis"] = outcomes[0].analysis
    if plan.probes is not None:
        obj["probes"] = [v for o in outcomes for v in (o.probes or [])]
    if plan.fidelity is not None:
        obj["sae_fidelity"] = fidelity_payload(plan, outcomes)
    if plan.monitor is not None and plan.attachment is not None and outcomes:
        out = outcomes[0]
        records = list(out.finish.activations)
        for t in out.tokens:
            records.extend(t.activations)
        obj["sae_activations"] = activations_payload(
            records=records,
            attachment=plan.attachment,
            read_point=plan.monitor.entries[0].read_point,
            prompt_ids=out.finish.prompt_token_ids,
            token_ids=out.finish.token_ids,
            prompt_tokens=out.finish.prompt_tokens,
            tokens=out.finish.tokens,
            labels=out.labels,
        )
    return obj


def usage_of(plan: Plan, outcomes: list[Outcome]) -> wire.Usage:
    prompt = 0
    seen: set[int] = set()
    n = plan.request.n
    for out in outcomes:
        group = out.choice.index // n  # choices of one prompt share their prompt tokens
        if group not in seen:
            seen.add(group)
            prompt += out.finish.usage.prompt_tokens
    completion = sum(o.finish.usage.completion_tokens for o in outcomes)
    return wire.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def count_usage(plan: Plan, usage: wire.Usage, *, unfinished: int = 0, outcomes: list[Outcome] | None = None) -> None:
    """Advance the token counters once per answered request, by the usage it reports
    (plus the tokens a stream sent for a choice that never finished), and the speculative
    decoding counters by its choices' drafts."""
    record_tokens(
        model=plan.model.name, completion_tokens=usage.completion_tokens + unfinished, prompt_tokens=usage.prompt_tokens
    )
    # the key's usage and quota: the tokens it was answered (inference.usage)
    request_ended(plan, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens + unfinished)
    speculative = _speculative(outcomes or [])
    if speculative is not None and speculative["used"]:
        record_speculative(model=plan.model.name, drafted=speculative["drafted"], accepted=speculative["accepted"])


def _text_offsets(tokens: list[str], text: str) -> list[int]:
    """Where each token starts in the choice's ``text`` (OpenAI's ``text_offset``): a token
    whose text is not there at that point (a BOS ``<s>`` the echoed prompt leaves out, a
    piece of a multi-byte character) starts where the next would and takes no room."""
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        if token and text.startswith(token, pos):
            pos += len(token)
    return offsets


def _completion_logprobs(plan: Plan, out: Outcome, text: str) -> wire.CompletionLogprobs:
    req = plan.request
    assert isinstance(req, CompletionRequest)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    if req.echo:
        # the prompt's own logprobs and, with logprobs >= 1, the alternatives at each
        # position: both from the request's prefill (steered as the request is)
        n_prompt = len(out.finish.prompt_token_ids)
        tokens += list(out.finish.prompt_tokens)
        token_logprobs += list(out.finish.prompt_logprobs or [None] * n_prompt)
        alternatives = out.finish.prompt_top_logprobs or [None] * n_prompt
        for i, entries in enumerate(alternatives):
            if i == 0:
                top.append(None)
                continue
            alt = {e.token: e.logprob for e in entries or ()}
            lp = token_logprobs[i]
            if lp is not None:
                alt.setdefault(tokens[i], lp)  # as for completion tokens: the chosen one too
            top.append(alt)
    for t in out.tokens:
        if t.logprob is None:
            continue
        tokens.append(t.logprob.token)
        token_logprobs.append(t.logprob.logprob)
        top.append(top_dict(t.logprob))
    return wire.CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=_text_offsets(tokens, text)
    )


def build_body(plan: Plan, outcomes: list[Outcome]) -> dict[str, Any]:
    millm = millm_object(plan, outcomes) if wants_millm(plan, outcomes) else None
    common = {
        "id": plan.object_id,
        "created": plan.created,
        "model": plan.model.name,
        "system_fingerprint": plan.fingerprint,
        "usage": usage_of(plan, outcomes),
        "millm": millm,
    }
    if plan.kind == "chat":
        wants = bool(getattr(plan.request, "logprobs", False))
        return wire.ChatCompletion(
            **common,
            service_tier=plan.request.answered_tier,
            choices=[
                wire.ChatChoice(
                    index=out.choice.index,
                    message=chat_message(plan, out.finish.text),
                    logprobs=wire.ChatLogprobs(
                        content=[wire.ChatTokenLogprob.of(t.logprob) for t in out.tokens if t.logprob is not None]
                    )
                    if wants
                    else None,
                    finish_reason=chat_finish_reason(plan, out.finish),
                )
                for out in outcomes
            ],
        ).dump()
    req = plan.request
    assert isinstance(req, CompletionRequest)
    choices = []
    for out in outcomes:
        text = out.finish.text
        if req.echo:
            text = (
                out.choice.prompt_text if out.choice.prompt_text is not None else out.finish.prompt_text or ""
            ) + text
        choices.append(
            wire.CompletionChoice(
                index=out.choice.index,
                text=text,
                logprobs=_completion_logprobs(plan, out, text) if req.wants_logprobs else None,
                finish_reason=wire.finish_reason(out.finish.finish_reason),
            )
        )
    return wire.Completion(**common, choices=choices).dump()


def chat_message(plan: Plan, text: str) -> wire.ChatMessage:
    """A chat choice's message: its text, or under tools the calls parsed out of it
    (``content`` null when nothing but calls)."""
    if plan.tools is None or not plan.tools.parses:
        return wire.ChatMessage(content=text)
    content, calls = parse_tool_calls(text, plan.tools)
    if not calls:
        return wire.ChatMessage(content=text)
    return wire.ChatMessage(content=tool_content(content, calls), tool_calls=[wire.ToolCall(**c) for c in calls])


def chat_finish_reason(plan: Plan, finish: FinishEvent) -> wire.FinishReason:
    calls = plan.tools is not None and plan.tools.parses and bool(parse_tool_calls(finish.text, plan.tools)[1])
    return wire.finish_reason(finish.finish_reason, tool_calls=calls)
