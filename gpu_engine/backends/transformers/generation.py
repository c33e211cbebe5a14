"""The serial decode loop: prefill, then one token per forward pass with a KV cache.

Sampling is ours (``Sampler``) rather than ``model.generate`` so that a step costs one
forward, one sample and one host sync (the token id, needed for EOS/stop detection and
streaming), and so that cancel and stop sequences take effect before the next forward.
Everything per request that is not a forward pass (sampling, text, stops, events) lives
in ``Sequence``, which the batch scheduler uses too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...capture import armed
from ...hooks import BatchContext, HookManager, RequestHooks, Segment
from ...protocol import FinishEvent, SamplingParams
from .runner import TransformersRunner
from .sequence import Emit, Sequence


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
) -> FinishEvent:
    seq = Sequence(runner, request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                   request_hooks=request_hooks, emit=emit, should_stop=should_stop)
    device = runner.device
    n_prompt = seq.n_prompt
    sampler = seq.sampler

    segment = Segment(request_hooks, 0, n_prompt, 0) if request_hooks is not None else None
    ctx = BatchContext([segment]) if segment is not None else None

    input_ids = seq.prompt
    cache_position = torch.arange(n_prompt, device=device)
    past = None

    capture = request_hooks.capture if request_hooks is not None else None
    with torch.inference_mode(), hook_manager.active(ctx), armed(hook_manager, runner, capture):
        for i in range(max_tokens):
            if should_stop():
                seq.cancel()
                break
            if segment is not None:
                segment.row_end = input_ids.shape[1]
                segment.start_position = n_prompt + i - 1 if i else 0
            echo = i == 0 and sampling.prompt_logprobs
            logits, past = runner.forward(input_ids, past, cache_position=cache_position, all_logits=echo)
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

    return seq.finish()


__all__ = ["run_generation"]
