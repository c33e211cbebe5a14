"""The serial decode loop: prefill, then one token per forward pass with a KV cache.

Sampling is ours (``Sampler``) rather than ``model.generate`` so that a step costs one
forward, one sample and one host sync (the token id, needed for EOS/stop detection and
streaming), and so that cancel and stop sequences take effect before the next forward.
Everything per request that is not a forward pass (sampling, text, stops, events) lives
in ``Sequence``, which the batch scheduler uses too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from ...interp.capture import armed
from ...interp.hooks import BatchContext, HookManager, RequestHooks, Segment
from ...api.protocol import FinishEvent, SamplingParams, SpeculativeStats
from ...decode.sequence import Emit, Sequence
from . import prefix
from .speculative import cut_cache, spec_eligible

if TYPE_CHECKING:  # the runner builds this module's objects: a type, not an import
    from .runner import TransformersRunner


def run_generation(
    runner: TransformersRunner,
    *,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    max_tokens: int,
    hook_manager: HookManager,
    request_hooks: RequestHooks | None,
    should_stop: Callable[[], bool],
    emit: Emit,
    prefix_plan: Any = None,
    distributions_from: int | None = None,
) -> FinishEvent:
    seq = Sequence(
        runner,
        request_id=request_id,
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        request_hooks=request_hooks,
        emit=emit,
        should_stop=should_stop,
        distributions_from=distributions_from,
    )
    drafter = runner.drafter  # None without SPECULATIVE_MODEL
    if drafter is not None:
        why_not = spec_eligible(seq)
        if why_not is None:
            return _run_speculative(
                runner, seq, drafter, hook_manager=hook_manager, request_hooks=request_hooks, should_stop=should_stop
            )
        seq.speculative = SpeculativeStats(
            used=False, source=drafter.source, num_tokens=drafter.num_tokens, reason=why_not
        )
    device = runner.device
    n_prompt = seq.n_prompt
    sampler = seq.sampler

    past = runner.serial_cache(n_prompt + max_tokens)  # None: the model's own DynamicCache
    dynamic = past is None
    # the prefix cache (prefix.py) on the dynamic cache: a hit starts from the stored KV and
    # prefills the rest of the prompt; a miss prefills into full layers, so that every
    # position can be stored at the end (the window still comes from the mask)
    cached = prefix_plan is not None and dynamic and runner.prefix_cache.enabled
    hit = prefix.look_up(runner.prefix_cache, prefix_plan, prompt_ids) if cached else None
    start = hit.length if hit is not None else 0
    if cached:
        past = prefix.start_cache(hit) if hit is not None else DynamicCache()
    segment = Segment(request_hooks, 0, n_prompt - start, start) if request_hooks is not None else None
    ctx = BatchContext([segment]) if segment is not None else None

    input_ids = seq.prompt[:, start:]
    cache_position = torch.arange(start, n_prompt, device=device)

    capture = request_hooks.capture if request_hooks is not None else None
    with torch.inference_mode(), hook_manager.active(ctx), armed(hook_manager, runner, capture):
        # decode steps after the prefill skip model.forward where they can (lean.py)
        lean = runner.lean_step() if dynamic else None
        try:
            for i in range(max_tokens):
                if should_stop():
                    seq.cancel()
                    break
                if segment is not None:
                    segment.row_end = input_ids.shape[1]
                    segment.start_position = n_prompt + i - 1 if i else start
                # the prefill returns the prompt rows' logits a request reads (echo_logprobs)
                echo = seq.echo_rows if i == 0 else 0
                if i and lean is not None:
                    logits = lean.step(input_ids, n_prompt + i - 1)
                else:
                    logits, past = runner.forward(input_ids, past, cache_position=cache_position, all_logits=echo)
                    if lean is not None:
                        lean.start(past, n_prompt, n_prompt + max_tokens)
                        past = None
                seq.forwards += 1
                if echo:
                    seq.echo_logprobs(logits)
                last = logits[-1]
                token = sampler.sample(last)
                sampler.observe(token)
                input_ids = token.view(1, 1)
                cache_position = cache_position[-1:] + 1
                lsm = torch.log_softmax(last.float(), dim=-1) if seq.want_lp else None
                # int(token) is the one host sync per step
                if seq.accept(int(token), lsm):
                    break
            if cached:
                # the KV held: the prompt and every generated token but the last
                held = n_prompt + max(len(seq.generated) - 1, 0)
                if lean is not None:
                    layers = lambda: [(k[0, :, :held], v[0, :, :held]) for k, v in zip(lean.k, lean.v)]  # noqa: E731
                else:
                    layers = lambda: [(layer.keys[0], layer.values[0]) for layer in past.layers]  # noqa: E731
                prefix.store(runner.prefix_cache, prefix_plan, prompt_ids, seq.generated, held, layers)
        finally:
            if lean is not None:
                lean.release()

    return seq.finish()


def _run_speculative(
    runner: TransformersRunner,
    seq: Sequence,
    drafter: Any,
    *,
    hook_manager: HookManager,
    request_hooks: RequestHooks | None,
    should_stop: Callable[[], bool],
) -> FinishEvent:
    """Greedy decoding with a draft (``speculative``): each main forward verifies up to
    ``drafter.num_tokens`` draft tokens and keeps the longest prefix the request's own
    sampler would have chosen, plus that sampler's next choice."""
    from transformers import DynamicCache

    device = runner.device
    sampler = seq.sampler
    n_prompt = seq.n_prompt
    segment = Segment(request_hooks, 0, n_prompt, 0) if request_hooks is not None else None
    ctx = BatchContext([segment]) if segment is not None else None
    drafter.start()
    drafter.drafted = drafter.accepted = 0
    seq.speculative = drafter.stats()
    # every layer keeps every position (a sliding-window layer's own cache trims, and
    # trimmed caches cannot be cut back); the window still comes from the mask
    past: Any = DynamicCache()
    with torch.inference_mode(), hook_manager.active(ctx):
        # the prefill, as in plain decoding
        echo = seq.echo_rows
        logits, past = runner.forward(
            seq.prompt, past, cache_position=torch.arange(n_prompt, device=device), all_logits=echo
        )
        seq.forwards += 1
        if echo:
            seq.echo_logprobs(logits)
        if _take(seq, sampler, logits[-1:], []):
            return _finish(seq, drafter)
        while True:
            if should_stop():
                seq.cancel()
                break
            context = seq.prompt_ids + seq.generated
            pos0 = len(context) - 1  # position of the last token, fed now
            k = min(drafter.num_tokens, seq.max_tokens - len(seq.generated) - 1)
            drafts = drafter.propose(context, k) if k > 0 else []
            ids = torch.tensor([[context[-1], *drafts]], dtype=torch.long, device=device)
            if segment is not None:
                segment.row_end = ids.shape[1]
                segment.start_position = pos0
            logits, past = runner.forward(
                ids, past, cache_position=torch.arange(pos0, pos0 + ids.shape[1], device=device), all_logits=True
            )
            seq.forwards += 1
            # how many drafts the main model agrees with (its sampler's choice, in order)
            choices = _choices(sampler, logits, drafts)
            matched = next((j for j, d in enumerate(drafts) if choices[j] != d), len(drafts))
            drafter.drafted += len(drafts)
            drafter.accepted += matched
            # keep the verified positions only: the cache, the draft cache, the monitors
            keep = pos0 + matched + 1
            cut_cache(past, keep)
            drafter.settle(keep)
            if request_hooks is not None:
                request_hooks.rewind(keep)
            if _take(seq, sampler, logits[: matched + 1], choices[: matched + 1]):
                break
    return _finish(seq, drafter)


def _choices(sampler: Any, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The sampler's choice at each verified position, up to the first that differs from
    its draft (the sampler sees the tokens before each one: penalties apply as in plain
    decoding); the penalty state is rolled forward by ``_take``, so it is copied here."""
    probe = _SamplerView(sampler)
    out: list[int] = []
    for j in range(logits.shape[0]):
        token = probe.sample(logits[j])
        out.append(int(token))
        if j >= len(drafts) or out[-1] != drafts[j]:
            break
        probe.observe(token)
    return out


class _SamplerView:
    """A request's sampler with its penalty state copied (``_choices`` looks ahead)."""

    def __init__(self, sampler: Any) -> None:
        self.s = copy.copy(sampler)
        for name in ("seen", "counts"):
            value = getattr(sampler, name, None)
            if value is not None:
                setattr(self.s, name, value.clone())

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        return self.s.sample(logits)

    def observe(self, token: torch.Tensor) -> None:
        self.s.observe(token)


def _take(seq: Sequence, sampler: Any, logits: torch.Tensor, choices: list[int]) -> bool:
    """Accept the tokens chosen at ``logits``' rows (choosing them when ``choices`` is
    empty: the prefill's one row); True when the request finished."""
    for j in range(logits.shape[0]):
        token = torch.tensor([choices[j]], device=logits.device) if choices else sampler.sample(logits[j])
        sampler.observe(token)
        lsm = torch.log_softmax(logits[j].float(), dim=-1) if seq.want_lp else None
        if seq.accept(int(token), lsm):
            return True
    return False


def _finish(seq: Sequence, drafter: Any) -> FinishEvent:
    seq.speculative = drafter.stats()
    return seq.finish()


__all__ = ["run_generation"]
